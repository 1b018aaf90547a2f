"""The in-memory checkpoint tier: every rank's shard in node-local memory, with a
replica on the next node.

A persistent checkpoint is read back from shared storage by every rank of a new
attempt; on a real cluster that is minutes for a large model. Most faults lose one
node, and the state of every rank on the other nodes is still in their memory. This
tier keeps it there, for the supervisor to resume from when it can:

- Save, every ``checkpoint.memory_every_steps``: the training thread copies its rank's
  local shards (model and AdamW state) into host buffers allocated once per run
  (trainer/staging.py), which is all it waits for. A background thread then writes the
  copy's raw bytes into the node's memory directory (``/dev/shm``) as one flat file
  (trainer/state_file.py, several threads at once), sends it to rank
  ``r + ranks_per_node`` (the same local rank on the next node, wrapping around) and
  writes the replica it receives from rank ``r - ranks_per_node``. Both go through a
  gloo group of their own, so the training thread's collectives never wait behind them.
  After a barrier on that group, the save of step N is whole: rank 0 reports it (tier
  "memory"). Before each save a node deletes every save but its newest whole one, so it
  holds two at most and never loses the one the supervisor last heard of.
- Restore (``--resume memory:A:N``, attempt A's save of step N): each rank lists what its
  node holds of it, the ranks share the lists, and for every rank whose own file is not
  on its node, the lowest rank holding a copy sends it over. If some rank's state is on
  no node of the new attempt, every rank raises CheckpointUnreadable (exit 3): the
  supervisor then resumes from the newest persistent checkpoint. A file on the rank's
  own node is mapped, not read: its tensors go straight from node memory into the
  model and optimizer (through pinned buffers into a GPU), several threads at once.

Rank r's state therefore survives the loss of its node as long as node ``r // L + 1``
(mod the node count) survives: the supervisor decides from the lost nodes and the
saving attempt's node order (supervisor/policy/memory.py) before it asks for a memory
resume; the check here is the proof.

Layout, under the directory ``$TSUP_MEMORY_DIR`` (the supervisor sets one per run) or
``checkpoint.memory_dir`` names::

    <root>/<node>/a0003-s00000045/rank_00002.pt     rank 2's state after step 45
                                  replica_00000.pt  rank 0's, sent by it (node 0)

(``.pt`` for the name's sake: the files are trainer/state_file.py's, or ``torch.save``'s
where an earlier trainer wrote them.) The root is made 0700 and checked as this user's
own (wire/private_dir.py): in /dev/shm any user could make the name first.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainer import checkpoint, distributed, state_file
from trainer.staging import StagedCopy, Staging
from wire.errors import CheckpointUnreadable, UsageError
from wire.private_dir import private_dir

WHOLE = "whole"  # in a save's directory once every rank's file and replica are in (the node leader's)
_SAVE_DIR = re.compile(r"a(\d{4,})-s(\d{8})")
_RESUME = re.compile(r"memory:(\d+):(\d+)")


def default_root(run_id: str) -> Path:
    shm = Path("/dev/shm")  # noqa: S108 (a directory of this user's own below it: private_dir)
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"tsup-memory-{os.geteuid()}" / run_id


def save_dir_name(attempt: int, step: int) -> str:
    return f"a{attempt:04d}-s{step:08d}"


def resume_name(attempt: int, step: int) -> str:
    """How ``--resume`` (and the supervisor's records) name attempt ``attempt``'s memory
    save of step ``step``."""
    return f"memory:{attempt}:{step}"


def parse_resume(text: str) -> tuple[int, int] | None:
    """(attempt, step) of a ``memory:A:N`` resume request; None for anything else."""
    if not text.startswith("memory:"):
        return None
    match = _RESUME.fullmatch(text)
    if match is None:
        raise UsageError(f"--resume {text}: expected memory:ATTEMPT:STEP")
    return int(match.group(1)), int(match.group(2))


def peer_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank that holds ``rank``'s replica: the same local rank on the next node."""
    return (rank + ranks_per_node) % world_size


@dataclass(frozen=True, slots=True)
class Saved:
    step: int
    # What training waited: the previous save (if still going), and the copy (what was
    # left of it at the next optimizer step: trainer/staging.py).
    blocking_s: float
    total_s: float  # from the copy to the barrier after the replica exchange
    size: int  # bytes of this rank's state


class MemoryTier:
    """One rank's side of the tier; every rank of the attempt makes one (collectively:
    it creates the tier's gloo group)."""

    def __init__(self, root: Path, node: str, attempt: int, ranks_per_node: int, *, device: torch.device,
                 io_threads: int) -> None:
        # Shards are the user's weights: a directory nobody else can enter or make first.
        self.node_dir = private_dir(root) / node
        self.attempt = attempt
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ranks_per_node = ranks_per_node
        self.is_node_leader = self.rank % ranks_per_node == 0
        self.group = distributed.background_group()
        self.io_threads = io_threads
        self.staging = Staging(device, threads=io_threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-tier")
        self._pending: Future[Saved] | None = None
        self._copy: StagedCopy | None = None  # the copy of the save in flight, until fenced
        self.restored_times = checkpoint.RestoreTimes()  # where the last restore's time went
        self.restored_from_peers = 0  # ranks whose state the last restore sent over from another node
        self.size = 0  # bytes of this rank's state, once a save measured it

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Lay out the staging buffers ahead of the first save (trainer/staging.py)."""
        self.staging.prepare(_local_state(model, optimizer))

    # --- save ---------------------------------------------------------------------

    def save(self, step: int, meta: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
             on_whole: Callable[[Saved], None]) -> None:
        """Start copying this rank's state to host memory, beside the next step, and hand
        the rest to the background thread; the caller must ``fence`` before its next
        optimizer step. ``on_whole`` runs on the background thread once every rank's save
        and replica of ``step`` are written."""
        started = time.perf_counter()  # training is blocked from here: the wait counts too
        self.wait()  # one save in flight at a time: the previous one's result first
        waited = time.perf_counter() - started
        self._copy = self.staging.begin(_local_state(model, optimizer))
        self._pending = self._worker.submit(self._write, step, meta, self._copy, started, waited, on_whole)

    def fence(self) -> None:
        """The state is about to change: the copy of the save in flight must be done."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.fence()

    @property
    def busy(self) -> bool:
        """A save is in flight (or done, its result not yet taken)."""
        return self._pending is not None

    def wait(self) -> Saved | None:
        """Wait for the save in flight (its error, if it failed, is raised here)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def poll(self) -> None:
        """Raise a finished background save's error without waiting for one in flight."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def _write(self, step: int, meta: dict[str, Any], copy: StagedCopy, started: float, waited: float,
               on_whole: Callable[[Saved], None]) -> Saved:
        directory = self.node_dir / save_dir_name(self.attempt, step)
        directory.mkdir(parents=True, exist_ok=True)
        if self.is_node_leader:
            self._prune(writing=step)
        own = directory / _own(self.rank)
        tmp = _tmp_name(own)
        state = copy.done()
        self.size = checkpoint.state_bytes(state)
        # Straight into node memory from the staging buffers: the one copy the save makes.
        state_file.write(tmp, meta, state, threads=self.io_threads)
        os.replace(tmp, own)
        del state
        peer = peer_of(self.rank, self.world, self.ranks_per_node)
        if peer != self.rank:  # one node: no other node to hold a replica
            source = (self.rank - self.ranks_per_node) % self.world
            replica = directory / _replica(source)
            _exchange(own, _tmp_name(replica), send_to=peer, receive_from=source, group=self.group)
            os.replace(_tmp_name(replica), replica)
        dist.barrier(group=self.group)  # every rank's file and replica are in memory
        if self.is_node_leader:
            (directory / WHOLE).touch()
        saved = Saved(step=step, blocking_s=waited + copy.blocked_s(), total_s=time.perf_counter() - started,
                      size=self.size)
        on_whole(saved)
        return saved

    def _prune(self, writing: int) -> None:
        """Before this attempt's save of step ``writing`` is written: every save of this
        node but this attempt's newest whole one goes (other attempts' saves too, once
        this attempt has a whole one: they are older). The newest whole save stays until
        the next one is whole and the one after starts, so the save the supervisor last
        heard of is there whatever instant a rank dies; the node holds two at most."""
        saves = []
        for entry in self.node_dir.iterdir():
            match = _SAVE_DIR.fullmatch(entry.name)
            if match is not None:
                saves.append((int(match.group(1)), int(match.group(2)), entry))
        whole = [(step, entry) for attempt, step, entry in saves
                 if attempt == self.attempt and step != writing and (entry / WHOLE).exists()]
        if not whole:
            return
        keep = max(whole)[1]
        for attempt, step, entry in saves:
            if entry != keep and not (attempt == self.attempt and step == writing):
                shutil.rmtree(entry, ignore_errors=True)

    # --- restore ------------------------------------------------------------------

    def restore(self, attempt: int, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load attempt ``attempt``'s memory save of ``step`` into the model and optimizer
        (collective); returns the trainer meta it was saved with."""
        directory = self.node_dir / save_dir_name(attempt, step)
        held = _held(directory)
        holders: list[list[int]] = [[] for _ in range(self.world)]
        dist.all_gather_object(holders, held, group=self.group)
        sources: dict[int, int] = {}
        for rank in range(self.world):
            if rank in holders[rank]:
                sources[rank] = rank
            else:
                having = [h for h in range(self.world) if rank in holders[h]]
                if not having:
                    raise CheckpointUnreadable(
                        f"memory:{attempt}:{step}: rank {rank}'s state after step {step} is on no node "
                        f"of this attempt (its node and the next one were both lost)")
                sources[rank] = having[0]
        local = sources[self.rank] == self.rank
        self.restored_from_peers = sum(1 for rank, source in sources.items() if source != rank)
        received: bytearray | None = None
        for rank in range(self.world):  # the same order everywhere: each send meets its receive
            source = sources[rank]
            if source == rank:
                continue
            if self.rank == source:
                _send(_file_of(directory, rank), rank, self.group)
            elif self.rank == rank:
                received = _receive(source, self.group)
        try:
            if local:
                with state_file.mapped(_file_of(directory, self.rank)) as data:
                    return self._load(data, model, optimizer)
            assert received is not None
            return self._load(memoryview(received), model, optimizer)
        except (RuntimeError, KeyError, ValueError, TypeError, EOFError, OSError) as e:
            raise CheckpointUnreadable(f"memory:{attempt}:{step}: rank {self.rank}'s state does not load: "
                                       f"{type(e).__name__}: {str(e)[:300]}") from e

    def _load(self, data: memoryview, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load a state file's bytes (or an earlier trainer's ``torch.save``) into the model
        and optimizer; returns the trainer meta saved with them."""
        try:
            meta, saved = state_file.read(data)
        except state_file.StateFileError:
            if bytes(data[:2]) != b"PK":  # torch.save's zip: an earlier trainer's save
                raise
            payload = torch.load(io.BytesIO(data), weights_only=True)
            meta, saved = payload["meta"], payload["state"]
        _load_into(model, optimizer, saved, threads=self.io_threads, times=self.restored_times)
        return dict(meta)

    def bytes_held(self, attempt: int, step: int, rank: int) -> int:
        """The size of ``rank``'s state in attempt ``attempt``'s save of ``step`` on this
        node (0: the node holds none of it)."""
        try:
            return _file_of(self.node_dir / save_dir_name(attempt, step), rank).stat().st_size
        except OSError:
            return 0

    def drop(self) -> None:
        """The run is done: give this node's memory back (the node's leader, after the
        other ranks are done with it)."""
        self.wait()
        if self.is_node_leader:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the run's directory, once no node uses it
                self.node_dir.parent.rmdir()

    def close(self) -> None:
        self.fence()
        with contextlib.suppress(Exception):
            self.wait()
        self._worker.shutdown(wait=False)
        self.staging.close()


# --- files --------------------------------------------------------------------------


def _own(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _replica(rank: int) -> str:
    return f"replica_{rank:05d}.pt"


def _held(directory: Path) -> list[int]:
    """The ranks whose state this node holds (its own ranks' files and replicas)."""
    if not directory.is_dir():
        return []
    held = set()
    for entry in directory.iterdir():
        match = re.fullmatch(r"(?:rank|replica)_(\d{5})\.pt", entry.name)
        if match is not None:
            held.add(int(match.group(1)))
    return sorted(held)


def _file_of(directory: Path, rank: int) -> Path:
    """The file of ``rank``'s state this node holds: its own, or the replica."""
    own = directory / _own(rank)
    return own if own.exists() else directory / _replica(rank)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


@contextlib.contextmanager
def _mapped(path: Path, size: int | None = None) -> Iterator[torch.Tensor]:
    """A file in node memory as a uint8 tensor over its pages, without a copy: an existing
    one to read (``size`` None), or a new one of ``size`` bytes to fill."""
    with open(path, "rb" if size is None else "w+b") as f:
        if size is not None:
            f.truncate(size)
        # ACCESS_COPY: a private mapping, which torch takes as writable; reading copies nothing.
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY if size is None else mmap.ACCESS_WRITE)
        try:
            tensor = torch.frombuffer(m, dtype=torch.uint8)
            yield tensor
            del tensor  # the mapping cannot close while a tensor still points into it
        finally:
            m.close()


# --- the wire -----------------------------------------------------------------------


def _exchange(outgoing: Path, incoming: Path, *, send_to: int, receive_from: int, group: Any) -> None:
    """Send the file ``outgoing`` to one rank while receiving another's into the new file
    ``incoming`` (sizes first), both straight from and into node memory."""
    size_out = torch.tensor([outgoing.stat().st_size], dtype=torch.int64)
    size_in = torch.zeros(1, dtype=torch.int64)
    _both(dist.isend(size_out, send_to, group=group), dist.irecv(size_in, receive_from, group=group))
    with _mapped(outgoing) as data_out, _mapped(incoming, int(size_in.item())) as data_in:
        _both(dist.isend(data_out, send_to, group=group), dist.irecv(data_in, receive_from, group=group))


def _both(*works: Any) -> None:
    for work in works:
        work.wait()


def _send(path: Path, to: int, group: Any) -> None:
    dist.send(torch.tensor([path.stat().st_size], dtype=torch.int64), to, group=group)
    with _mapped(path) as data:
        dist.send(data, to, group=group)


def _receive(source: int, group: Any) -> bytearray:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, source, group=group)
    data = bytearray(int(size.item()))
    if data:
        dist.recv(torch.frombuffer(data, dtype=torch.uint8), source, group=group)
    return data


# --- state --------------------------------------------------------------------------


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of the model and optimizer state: views of the live tensors."""
    model_state, optim_state = get_state_dict(model, optimizer)
    local: dict[str, Any] = checkpoint.map_tensors(
        {"model": model_state, "optimizer": optim_state},
        lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach())
    return local


def _pair(live: Any, saved: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]], where: str = "") -> Any:
    """Match ``saved`` to the tensors of ``live`` (same structure), noting each (live
    tensor, saved tensor) to copy in ``pairs``; returns the tree to hand back (non-tensor
    values are taken from ``saved``)."""
    if isinstance(live, torch.Tensor):
        target = live.to_local() if isinstance(live, DTensor) else live
        if not isinstance(saved, torch.Tensor) or saved.shape != target.shape or saved.dtype != target.dtype:
            got = (f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor)
                   else type(saved).__name__)
            raise ValueError(f"{where}: saved {got}, this run's {tuple(target.shape)} {target.dtype}")
        pairs.append((target, saved))
        return live
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(live) != set(saved):
            raise KeyError(f"{where or 'state'}: saved keys differ from this run's")
        return {k: _pair(live[k], saved[k], pairs, f"{where}.{k}") for k in live}
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(live) != len(saved):
            raise ValueError(f"{where}: saved {saved!r:.80}, this run's length {len(live)}")
        matched = enumerate(zip(live, saved, strict=True))
        return type(live)(_pair(a, b, pairs, f"{where}[{i}]") for i, (a, b) in matched)
    return saved


def _load_into(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], *,
               threads: int, times: checkpoint.RestoreTimes) -> None:
    started = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)  # creates AdamW's state entries
    laid_out = time.perf_counter()
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    model_state = _pair(model_state, saved["model"], pairs, "model")
    optim_state = _pair(optim_state, saved["optimizer"], pairs, "optimizer")
    state_file.copy_into(pairs, threads=threads)
    read = time.perf_counter()
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    times.layout_s, times.read_s = laid_out - started, read - laid_out
    times.apply_s = time.perf_counter() - read
    times.size = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
