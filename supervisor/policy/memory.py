"""Whether the next attempt can resume from the in-memory checkpoint tier (pure).

The reference trainer's memory tier (trainer/memory_tier.py) keeps rank r's state in the
memory of its node and a replica on the next node of the saving attempt, wrapping
around: with the saving attempt's nodes S[0..N-1] in rank order, rank r's state is on
S[i] and S[(i + 1) mod N], where i is r's node. The holders must be among the next
attempt's nodes, since its ranks pass the state on; a node that left the run (drained,
replaced, released) took its memory with it. So the memory save can be resumed from
when, for every i, S[i] or S[i + 1] is in the next attempt. One lost node is always
covered; two lost nodes are, unless they are neighbours in S.

The trainer checks the same thing from the files it finds before it loads anything:
if this judgement was wrong (a node kept its name but lost its memory), every rank
exits 3 and the run resumes from its newest persistent checkpoint instead.
"""

from __future__ import annotations

from collections.abc import Collection

from supervisor.domain import Attempt, CheckpointRef, MemoryCheckpointRecord, MemoryCheckpointRef


def unrecoverable(save: MemoryCheckpointRef, nodes: Collection[str]) -> list[str]:
    """The saving attempt's nodes whose ranks' state is on none of ``nodes`` (empty: the
    save can be resumed from on ``nodes``)."""
    ring = save.nodes
    here = set(nodes)
    if len(ring) != len(here):
        return list(ring)  # another world size: the shards do not fit
    if len(ring) == 1:
        return [] if ring[0] in here else list(ring)
    return [node for i, node in enumerate(ring) if node not in here and ring[(i + 1) % len(ring)] not in here]


def newest_resumable(saves: list[MemoryCheckpointRecord], attempts: tuple[Attempt, ...],
                     persistent: CheckpointRef | None, before_step: int | None,
                     unreadable: frozenset[int]) -> MemoryCheckpointRef | None:
    """The newest save of the memory tier worth resuming from: as new as the newest
    persistent checkpoint or newer (a node that holds it is not read from storage),
    before a rollback's step, never found unreadable."""
    usable = [s for s in saves
              if s.step >= (persistent.step if persistent else 1) and s.step not in unreadable
              and (before_step is None or s.step < before_step) and 0 < s.attempt <= len(attempts)]
    if not usable:
        return None
    save = max(usable, key=lambda s: (s.step, s.attempt))
    return MemoryCheckpointRef(attempt=save.attempt, step=save.step, nodes=attempts[save.attempt - 1].nodes)
