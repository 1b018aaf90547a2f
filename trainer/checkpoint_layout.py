"""Checkpoint directory layout, completeness rule and retention (stdlib only).

The supervisor relies on this layout exactly::

    <checkpoint.dir>/
        step_00000020/              a COMPLETE checkpoint of the state after step 20
            .metadata               written by torch.distributed.checkpoint (DCP) last
            __0_0.distcp ...        one or more DCP data files per rank
            trainer_meta.json       step, consumed_samples, world_size, model, ...
            manifest.json           every other file's size and hash (BLAKE3)
        step_00000030/
        .tmp-step_00000040/         a save in progress (or abandoned by a crash)

Completeness rule: a checkpoint is COMPLETE if and only if it is a directory whose name
is ``step_`` followed by exactly 8 digits (no ``.tmp-`` prefix) and that contains both
``.metadata`` and ``trainer_meta.json``. Anything else is not a checkpoint.

How a save makes that true atomically:

1. rank 0 removes a leftover ``.tmp-step_N/`` from an earlier crash; barrier;
2. every rank writes its shards with DCP into ``.tmp-step_N/`` (DCP's coordinator writes
   ``.metadata`` after all ranks' data, and fsyncs the files);
3. every rank hashed its own files while it wrote them (trainer/checkpoint_io.py);
   rank 0 gathers the sizes and hashes into ``manifest.json``, then writes
   ``trainer_meta.json`` (each: tmp file, fsync, rename); barrier;
4. rank 0 renames ``.tmp-step_N/`` to ``step_N/`` and fsyncs ``<checkpoint.dir>``.
   The rename is the commit point: before it the checkpoint does not exist by name.

The manifest is checked before a resume: the supervisor compares the sizes (a stat per
file, before it chooses the checkpoint), the trainer the hashes (each rank the files it
reads, as it reads them: the check costs no second read). A checkpoint whose files
differ from what was written is unreadable (exit code 3): the supervisor never resumes
from it again. Checkpoints written before manifests existed load without the check.

Manifest formats: 2 (this one) names each file's hash by its algorithm, ``blake3``
(the ``blake3`` package: a cryptographic hash at several GB/s a core, where SHA-256
does 1.5 to 2) or ``sha256`` where that package is missing; format 1 (SHA-256 only) is
still read and verified.

After each commit rank 0 prunes (``prune``): complete checkpoints with a step greater
than the one just committed (left by an abandoned trajectory, e.g. after a rollback)
and all but the newest ``keep`` complete checkpoints are deleted, and so is every
``.tmp-*`` entry. A deleted checkpoint is first renamed to ``.tmp-delete-step_N`` so
that it stops being complete in one atomic step, then removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainer import atomic
from wire.errors import CheckpointMismatch, Superseded, UsageError
from wire.files import FENCE_FILE, MANIFEST_FILE, checkpoint_name, read_small, step_of

META_FILE = "trainer_meta.json"
MANIFEST_FORMAT = 2  # format 1 (SHA-256 only) is read too
HASHES = ("blake3", "sha256")  # the algorithms a manifest entry may name, fastest first
DCP_METADATA_FILE = ".metadata"
TMP_PREFIX = ".tmp-"
META_FORMAT = 1  # bump when trainer_meta.json changes incompatibly


def is_complete(path: Path) -> bool:
    return (step_of(path.name) is not None and path.is_dir()
            and (path / DCP_METADATA_FILE).is_file() and (path / META_FILE).is_file())


def complete_checkpoints(root: Path, *, step_of: Callable[[str], int | None] = step_of,
                         is_complete: Callable[[Path], bool] = is_complete) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first (by default
    the reference trainer's; NxD Training's with its own ``step_of`` and ``is_complete``)."""
    if not root.is_dir():
        return []
    return sorted((step, entry) for entry in root.iterdir()
                  if (step := step_of(entry.name)) is not None and is_complete(entry))


def newest_complete(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(request: str, root: Path, *, step_of: Callable[[str], int | None] = step_of,
                   is_complete: Callable[[Path], bool] = is_complete,
                   expected: str = f"a step_NNNNNNNN directory with {DCP_METADATA_FILE} and {META_FILE}",
                   ) -> Path | None:
    """The checkpoint ``--resume`` asks for: ``auto`` (newest complete, or none), ``none``,
    or a path that must be a complete checkpoint (else UsageError: retrying won't help).
    The reference trainer's by default; NxD Training's with its own names and markers.
    """
    if request == "none":
        return None
    if request == "auto":
        found = complete_checkpoints(root, step_of=step_of, is_complete=is_complete)
        return found[-1][1] if found else None
    path = Path(request)
    if not is_complete(path):
        raise UsageError(f"--resume {request}: not a complete checkpoint (expected {expected})")
    return path


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerMeta:
    """What the trainer needs beyond the tensors to continue exactly where it stopped."""

    step: int  # optimizer steps completed; the next step is step + 1
    consumed_samples: int  # data stream position (see trainer.data)
    world_size: int
    model: str  # shape name, e.g. "llama2-7b"
    model_shape: dict[str, Any]  # the resolved shape, overrides included
    config_digest: str  # trainer.config.config_digest of the writing run
    last_loss: float | None  # loss of step ``step``, reported again by a run that resumes
    saved_at: float = field(default_factory=time.time)  # unix seconds
    format: int = META_FORMAT

    def write(self, directory: Path) -> None:
        atomic.write_json(directory / META_FILE, asdict(self))

    @classmethod
    def read(cls, directory: Path) -> TrainerMeta:
        path = directory / META_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != META_FORMAT:
                raise CheckpointMismatch(f"{path}: format {data.get('format')!r}, this "
                                         f"trainer reads {META_FORMAT}")
            return cls(**data)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointMismatch(f"{path}: unreadable: {e}") from e

    def check_compatible(self, *, world_size: int, model: str,
                         model_shape: dict[str, Any], reshard: bool) -> None:
        """Raise CheckpointMismatch unless this run can resume from here: the same model,
        and the same world size unless the checkpoint can be ``reshard``ed on load (a
        persistent DCP checkpoint can; a memory checkpoint's per-rank files cannot)."""
        if self.world_size != world_size and not reshard:
            raise CheckpointMismatch(
                f"checkpoint at step {self.step} was written by {self.world_size} ranks, "
                f"this run has {world_size}; it restores only on the same world size")
        if self.model != model or self.model_shape != model_shape:
            raise CheckpointMismatch(
                f"checkpoint at step {self.step} holds model {self.model!r} "
                f"{self.model_shape}, this run builds {model!r} {model_shape}")


def manifest_names(directory: Path) -> list[str]:
    """The files a manifest covers, sorted: everything but the manifest and the meta file."""
    return sorted(p.name for p in directory.iterdir()
                  if p.is_file() and p.name not in (MANIFEST_FILE, META_FILE))


def bytes_per_rank(directory: Path, world_size: int) -> int:
    """About the bytes each of the ``world_size`` ranks that wrote a complete checkpoint
    holds in it: its data files' total, shared out (what a restore of it moves)."""
    try:
        total = sum((directory / name).stat().st_size for name in manifest_names(directory))
    except OSError:
        return 0
    return total // max(1, world_size)


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The part of ``names`` that ``rank`` hashes (on save) or checks (on restore)."""
    return names[rank::world_size]


class Hasher(Protocol):
    def update(self, data: Any, /) -> object: ...
    def hexdigest(self) -> str: ...


def hash_name() -> str:
    """The algorithm new manifests use: BLAKE3 when its package is installed."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return "sha256"
    return "blake3"


def new_hasher(name: str) -> Hasher:
    """A hasher of one of HASHES (BLAKE3 releases the GIL on large inputs: threads hash
    in parallel)."""
    if name == "blake3":
        try:
            import blake3
        except ImportError:  # the checkpoint is fine; this trainer's installation is not
            raise UsageError("this checkpoint's manifest hashes with BLAKE3 and the blake3 package is not "
                             "installed (pip install blake3; the trainer's extras have it)") from None
        return blake3.blake3()
    if name == "sha256":
        return hashlib.sha256()
    raise CheckpointMismatch(f"unknown hash {name!r} (this trainer knows {', '.join(HASHES)})")


def entry_hash(entry: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest entry."""
    for name in HASHES:
        if isinstance(entry.get(name), str):
            return name, entry[name]
    raise CheckpointMismatch(f"a manifest entry with no hash this trainer knows: {sorted(entry)}")


def file_entry(path: Path, algorithm: str | None = None) -> dict[str, Any]:
    """A manifest's entry for one file: its size and hash, read in 8 MiB pieces."""
    name = algorithm or hash_name()
    digest = new_hasher(name)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, name: digest.hexdigest()}


def write_manifest(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    atomic.write_json(directory / MANIFEST_FILE,
                      {"format": MANIFEST_FORMAT, "files": dict(sorted(files.items()))})


def manifest_problems(directory: Path, files: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """How the files ``names`` of ``directory`` differ from the manifest ``files``."""
    problems = []
    for name in names:
        want = files[name]
        try:
            algorithm, _ = entry_hash(want)
            got = file_entry(directory / name, algorithm)
        except OSError as e:
            problems.append(f"{name}: {e.strerror or e}")
            continue
        problem = entry_problem(name, want, got)
        if problem:
            problems.append(problem)
    return problems


def entry_problem(name: str, want: dict[str, Any], got: dict[str, Any]) -> str:
    """How the file ``name`` as read (``got``: its size and hash) differs from its manifest
    entry ``want`` ("" if it does not)."""
    if got["size"] != want.get("size"):
        return f"{name} is {got['size']} bytes, the manifest says {want.get('size')}"
    algorithm, wanted = entry_hash(want)
    if got.get(algorithm) != wanted:
        return (f"{name}'s {algorithm.upper()} is {str(got.get(algorithm))[:12]}..., the manifest says "
                f"{wanted[:12]}...")
    return ""


def live_attempt(root: Path) -> int | None:
    """The attempt the supervisor last started on ``root`` (None: none said; a run without
    a supervisor, or one written before the fence)."""
    try:
        data = json.loads(read_small(root / FENCE_FILE, 4096))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise Superseded(f"{root / FENCE_FILE}: unreadable ({e}): this process will not change "
                         "the run's checkpoints") from e
    attempt = data.get("attempt") if isinstance(data, dict) else None
    return attempt if isinstance(attempt, int) else None


def check_fence(root: Path, attempt: int | None) -> None:
    """Raise Superseded when a later attempt than ``attempt`` is live on ``root``: a rank 0
    frozen through its attempt's end must not remove the live attempt's temporary save,
    nor prune the new trajectory's checkpoints. (Checked before each change, not held:
    a process frozen between the check and the change is not covered.)"""
    if attempt is None:
        return
    live = live_attempt(root)
    if live is not None and live > attempt:
        raise Superseded(f"attempt {live} of this run is live on {root}; this is attempt {attempt}, "
                         "which must not clear, commit or prune its checkpoints")


def tmp_dir_for(root: Path, step: int) -> Path:
    return root / f"{TMP_PREFIX}{checkpoint_name(step)}"


def clear_tmp(root: Path, step: int) -> Path:
    """Rank 0, before a save: make sure ``.tmp-step_N`` is absent; return its path."""
    tmp = tmp_dir_for(root, step)
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def commit(tmp: Path, step: int) -> Path:
    """Rank 0: rename a fully written ``.tmp-step_N`` to ``step_N``; the commit point."""
    final = tmp.parent / checkpoint_name(step)
    if final.exists():
        # A checkpoint of the same step from an abandoned trajectory (the run rolled back
        # past it): retire it first, since rename cannot replace a non-empty directory.
        _retire(final)
    atomic.rename_dir(tmp, final)
    return final


def prune(root: Path, *, keep: int, committed_step: int) -> list[Path]:
    """Rank 0, after a commit: apply the retention rule above; returns what was deleted."""
    complete = complete_checkpoints(root)
    doomed = [path for step, path in complete if step > committed_step]
    kept = [path for step, path in complete if step <= committed_step]
    doomed += kept[:-keep]
    for path in doomed:
        _retire(path)
    deleted = list(doomed)
    for entry in root.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
    return deleted


def _retire(path: Path) -> None:
    """Delete a checkpoint so that it is never seen half-deleted under its real name."""
    graveyard = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{os.getpid()}")
    os.rename(path, graveyard)
    shutil.rmtree(graveyard, ignore_errors=True)
