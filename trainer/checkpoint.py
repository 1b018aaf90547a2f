"""Saving and restoring the training state with PyTorch distributed checkpointing (DCP).

The on-disk layout, the completeness rule the supervisor relies on, and retention are
in trainer/checkpoint_layout.py; the threads that write, read and hash the files are
trainer/checkpoint_io.py's; this module moves the tensors. Every rank calls ``save`` and
``load`` (they are collectives); only rank 0 touches directory names.

What a checkpoint holds: the model and AdamW state (sharded, one DCP entry each) plus
trainer_meta.json (step and data position). The learning rate is a function of the step
and the data order a function of (seed, consumed samples), so nothing else is needed
for a resumed run to continue bit for bit.
"""

from __future__ import annotations

import errno
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from trainer import checkpoint_layout as layout
from trainer import distributed
from trainer.checkpoint_io import HashingWriter, VerifyingReader
from wire.errors import CheckpointMismatch, CheckpointStorageFull, CheckpointUnreadable
from wire.files import checkpoint_name, read_manifest


@dataclass(slots=True)
class RestoreTimes:
    """Where a restore's time went, on this rank (seconds), and the bytes it read."""

    layout_s: float = 0.0  # the live state laid out to load into (a fresh optimizer's moments made)
    read_s: float = 0.0  # the bytes read (and verified, where this rank verifies them) and copied in
    apply_s: float = 0.0  # handed to the model and optimizer
    size: int = 0

    def __str__(self) -> str:
        return (f"state laid out in {self.layout_s:.3f} s, read and copied in {self.read_s:.3f} s, "
                f"applied in {self.apply_s:.3f} s")


@dataclass(frozen=True, slots=True)
class SaveResult:
    path: Path  # the committed step_N directory
    duration_s: float  # wall time of the whole save, first barrier to commit
    deleted: list[Path]  # checkpoints and leftovers pruned after the commit (rank 0 only)


def stage(model: nn.Module, optimizer: torch.optim.Optimizer, *, tamper: bool = False) -> dict[str, Any]:
    """The training state as ``save`` takes it. The tensors are this rank's shards
    themselves, which the next optimizer step changes: a save that runs beside training
    saves a copy (trainer/staging.py). ``tamper`` (a chaos drill, on one rank): one weight
    of this rank's shard is saved changed."""
    model_state, optim_state = get_state_dict(model, optimizer)
    if tamper:
        model_state = _tampered(model_state)
    return {"model": model_state, "optimizer": optim_state}


def map_tensors(state: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``state`` (nested dicts, lists, tuples) with ``fn`` applied to every tensor."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {k: map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(map_tensors(v, fn) for v in state)
    return state


def state_bytes(state: Any) -> int:
    """The bytes of this rank's part of every tensor in ``state`` (a DTensor's local shard)."""
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()

    map_tensors(state, count)
    return total


def save(root: Path, meta: layout.TrainerMeta, state: dict[str, Any], *, keep: int, is_main: bool,
         before_commit: Callable[[], None] | None = None, group: Any = None,
         io_threads: int = 2, attempt: int | None = None) -> SaveResult:
    """Write ``state`` (from ``stage``, or its copy), the state after step ``meta.step``,
    with ``io_threads`` writer threads a rank, and commit it as ``root/step_N``. Every
    rank calls it, on the training thread, or on a background thread with ``group`` a
    process group of its own (an asynchronous save).

    ``before_commit`` runs on every rank once its shards are written (a chaos drill's
    hook). ``attempt``: this process's attempt, checked against the supervisor's fence
    before rank 0 clears, commits or prunes (Superseded when a later one is live). A
    write that fails for lack of space, quota or a read-only file system raises
    CheckpointStorageFull, after rank 0 removed the partial directory."""
    try:
        return _save(root, meta, state, keep=keep, is_main=is_main, before_commit=before_commit, group=group,
                     io_threads=io_threads, attempt=attempt)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = _storage_error(e)
        if error is None:
            raise
        if is_main:
            layout.clear_tmp(root, meta.step)  # give back what the partial save took
        raise CheckpointStorageFull(f"cannot write the checkpoint of step {meta.step} to {root}: "
                                    f"{error}") from e


def _tampered(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the first element of this rank's part of its first non-empty tensor
    raised by 1e-3, in a copy: the live model is untouched."""
    out = dict(state)
    for name in sorted(state):
        copy = state[name].detach().clone()
        local = copy.to_local() if hasattr(copy, "to_local") else copy
        if local.numel():
            with torch.no_grad():
                local.view(-1)[0] += 1e-3
            out[name] = copy
            return out
    return out


def _storage_error(e: BaseException) -> OSError | None:
    """The out-of-space (or quota, or read-only) error behind a failed save, if that is
    what it was: DCP wraps each rank's error in a CheckpointException."""
    for err in _behind(e):
        if isinstance(err, OSError) and err.errno in _STORAGE_ERRNOS:
            return err
        if isinstance(err, RuntimeError) and _SHORT_WRITE.search(str(err)):
            return OSError(errno.ENOSPC, f"No space left on device (a short write: {str(err).strip()[:200]})")
    return None


def _behind(e: BaseException) -> Iterator[BaseException]:
    """``e`` and every error behind it: its causes, and each rank's error inside DCP's
    CheckpointException."""
    seen: list[BaseException] = [e]
    visited: set[int] = set()
    while seen:
        err = seen.pop(0)
        if id(err) in visited:
            continue
        visited.add(id(err))
        yield err
        if isinstance(err, CheckpointException):
            seen.extend(exc for exc, _trace in err.failures.values())
        seen.extend(x for x in (err.__cause__, err.__context__) if x is not None)


_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
# torch.save's zip writer reports a write cut short by a full file system without the
# errno: "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598".
_SHORT_WRITE = re.compile(r"inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+")


def _save(root: Path, meta: layout.TrainerMeta, state: dict[str, Any], *, keep: int, is_main: bool,
          before_commit: Callable[[], None] | None, group: Any, io_threads: int,
          attempt: int | None) -> SaveResult:
    started = time.monotonic()
    tmp = layout.tmp_dir_for(root, meta.step)
    if is_main:
        layout.check_fence(root, attempt)
        layout.clear_tmp(root, meta.step)
    distributed.barrier(group)  # nobody writes into a directory rank 0 is still clearing
    writer = HashingWriter(tmp, threads=io_threads)
    dcp_save(state, storage_writer=writer, process_group=group)
    # DCP's coordinator writes .metadata before save returns on any rank: every file is
    # there, and each was hashed by the rank that wrote it.
    parts = distributed.all_gather_objects(writer.entries, group)
    files = {name: entry for part in parts for name, entry in part.items()}
    if is_main:
        for name in set(layout.manifest_names(tmp)) - set(files):  # written by none of the writers
            files[name] = layout.file_entry(tmp / name)
        layout.write_manifest(tmp, files)
        meta.write(tmp)
    if before_commit is not None:
        before_commit()
    distributed.barrier(group)  # every rank's shards and the meta file are on storage
    deleted: list[Path] = []
    final = tmp.parent / checkpoint_name(meta.step)
    if is_main:
        layout.check_fence(root, attempt)  # frozen meanwhile? the live attempt's directory is its own
        final = layout.commit(tmp, meta.step)
        deleted = layout.prune(root, keep=keep, committed_step=meta.step)
    return SaveResult(path=final, duration_s=time.monotonic() - started, deleted=deleted)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
         io_threads: int = 2) -> RestoreTimes:
    """Restore model and optimizer state in place from a complete checkpoint, reading its
    files with ``io_threads`` threads a rank; returns where the time went.

    Each file is checked against the checkpoint's manifest as it is read, by one rank
    (trainer/checkpoint_io.py). Raises CheckpointUnreadable when a file differs from the
    manifest, or a shard cannot be read (truncated, corrupt, gone): DCP shares what each
    rank found, so all of them raise it together."""
    try:
        manifest = read_manifest(path)
    except CheckpointMismatch as e:
        raise CheckpointUnreadable(str(e)) from e
    rank, world = distributed.rank_and_world()
    reader = VerifyingReader(path, manifest=manifest, threads=io_threads, rank=rank, world_size=world)
    times = RestoreTimes()
    try:
        _load(model, optimizer, reader, times)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        mismatch = next((x for x in _behind(e) if isinstance(x, CheckpointMismatch)), None)
        if mismatch is not None:
            raise CheckpointUnreadable(str(mismatch)) from e
        raise CheckpointUnreadable(f"{path}: {type(e).__name__}: {_reason(e)}") from e
    times.size = reader.bytes_read
    return times


def _reason(e: BaseException) -> str:
    """DCP's errors carry every rank's traceback; the reason is the last line of the first."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0]]
    return (errors[0] if errors else lines[0] if lines else "")[:500]


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, reader: VerifyingReader,
          times: RestoreTimes) -> None:
    started = time.perf_counter()
    # get_state_dict gives the sharded tensors to load into (and creates the optimizer
    # state entries that a fresh AdamW does not have yet, by a zero-lr step).
    model_state, optim_state = get_state_dict(model, optimizer)
    laid_out = time.perf_counter()
    # DCP loads in place into the tensors of this dict (and may replace the entries of
    # non-tensor values), so read them back out of it before handing them over.
    state = {"model": model_state, "optimizer": optim_state}
    dcp_load(state, storage_reader=reader)
    read = time.perf_counter()
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    times.layout_s, times.read_s = laid_out - started, read - laid_out
    times.apply_s = time.perf_counter() - read
