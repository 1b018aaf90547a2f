"""Find the newest complete checkpoint in a run's checkpoint directory.

The supervisor resumes trainers it did not write, so it knows the layouts users already
have. Each layout says when a save is *complete* (the file its writer writes last is
there) and when it is *verified* (nothing visibly truncated inside). A directory entry
that is not a checkpoint of any layout is ignored; one that is gives a ``Verdict``.

| layout   | a checkpoint is the directory     | complete when                         | verified when       |
|----------|-----------------------------------|---------------------------------------|---------------------|
| tsup     | step_00000040/ (8 digits, renamed | non-empty .metadata, and              | each file has the   |
|          | in; .tmp-step_* never is one)     | trainer_meta.json names the same step | size manifest.json  |
|          |                                   |                                       | says (none: no      |
|          |                                   |                                       | empty *.distcp)     |
| nxd      | step_5/ with checkpoint or done   | done exists (checkpoint comes first)  | no empty *.pt in    |
|          |                                   |                                       | it, model/, optim/  |
| nemo     | <name>step=5<...>.ckpt/ (also     | done exists and no sibling marker:    | as nxd              |
|          | <...>-last.ckpt/)                 | path less .ckpt, -EMA, +"-unfinished" |                     |
| hf       | checkpoint-500/                   | trainer_state.json parses (it is      | global_step is 500; |
|          |                                   | written last)                         | no empty weights    |
| megatron | iter_0000002/; release/ (step 0)  | iteration <= the one named by         | mp_rank_*/model_    |
|          | when the tracker says "release"   | latest_checkpointed_iteration.txt     | optim_rng.pt or DCP |
| dcp      | llama_v3-50steps/ or step-50/     | non-empty .metadata (.metadata.tmp    | no empty *.distcp   |
|          | holding DCP files                 | alone: the save was cut short)        |                     |
| lightning| a file <...>step=40<...>.ckpt     | the zip's end record is there (what   | as complete         |
|          | (ModelCheckpoint's "{step}")      | torch.save writes last)               |                     |

Layouts are tried in that order for each entry; the first that claims it wins (``dcp``,
whose names are the most generic, comes last). Candidates are sorted newest first, an ok
verdict before a failed one of the same step, so that a newest checkpoint that fails
verification falls back to the one before it.

The trainer deletes old checkpoints while we look: a checkpoint that vanishes during
inspection is "not a checkpoint", never an error. A garbage marker file makes a failed
verdict with the reason, never an exception.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from supervisor import user_files
from wire.errors import CheckpointMismatch
from wire.files import MANIFEST_FILE, nxd_step_of, read_manifest, step_of

LAYOUTS = ("tsup", "nxd", "nemo", "hf", "megatron", "dcp", "lightning")
# The largest step a checkpoint may name: what SQLite's INTEGER holds. A name beyond it
# ("checkpoint-99999999999999999999") is no checkpoint of a real run: it is passed over.
MAX_STEP = 2**63 - 1
# A marker file (trainer_meta.json, trainer_state.json, the Megatron tracker) is small;
# a bigger one is garbage, never read whole.
_MARKER_MAX_BYTES = 1 << 20

_NEMO_STEP = re.compile(r"(?<![A-Za-z])step=(\d+)")  # PTL's "{step}" in the filename template
_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")  # Megatron's iter_{:07d}
_DCP_DIR = re.compile(r"^(?:.+-(\d+)steps|step[-_](\d+))$")  # the FSDP test case's, torchtitan's
_TRACKER = "latest_checkpointed_iteration.txt"
SET_ASIDE = ".set-aside"  # in a checkpoint directory: checkpoints moved out of a trainer's way (set_aside)

# Megatron's tracker: (iteration, is "release") or why it cannot be trusted.
_Tracker = tuple[int, bool] | str


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    step: int
    path: Path
    ok: bool
    why: str  # empty when ok
    layout: str  # one of LAYOUTS


def _verdict(layout: str, step: int, path: Path, why: str) -> Verdict:
    return Verdict(step=step, path=path, ok=not why, why=why, layout=layout)


def _empty(root: Path, *patterns: str) -> list[str]:
    """The zero-byte files under ``root`` matching ``patterns``: writes cut short."""
    return sorted(str(p.relative_to(root)) for pattern in patterns for p in root.glob(pattern)
                  if p.is_file() and p.stat().st_size == 0)


def _tsup(path: Path) -> Verdict | None:
    step = step_of(path.name)
    if step is None or not path.is_dir():
        return None

    def bad(why: str) -> Verdict:
        return _verdict("tsup", step, path, why)

    metadata = path / ".metadata"
    if not metadata.is_file() or metadata.stat().st_size == 0:
        return bad("no .metadata (the save did not finish)")
    try:
        meta = json.loads(user_files.read_text(path / "trainer_meta.json", _MARKER_MAX_BYTES))
    except (OSError, ValueError) as e:
        return bad(f"trainer_meta.json unreadable: {e}")
    if not isinstance(meta, dict) or meta.get("step") != step:
        return bad(f"trainer_meta.json names step {meta.get('step') if isinstance(meta, dict) else '?'}")
    if (path / MANIFEST_FILE).exists():  # the hashes are the trainer's to check, each rank its share
        return bad(_manifest_sizes(path))
    empty = _empty(path, "*.distcp")
    return _verdict("tsup", step, path, f"empty shard file(s): {', '.join(empty)}" if empty else "")


def _manifest_sizes(path: Path) -> str:
    """How the files of a checkpoint differ in size from its manifest ("" if they do not)."""
    try:
        files = read_manifest(path) or {}
        wanted = {name: int(entry["size"]) for name, entry in files.items()}
    except (CheckpointMismatch, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST_FILE} unreadable: {e}"
    for name, size in wanted.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing (its manifest lists it)"
        if actual != size:
            return f"{name} is {actual} bytes, its manifest says {size}"
    return ""


def _nxd_problem(path: Path) -> str:
    # NxD writes `checkpoint` when a save begins and `done` only after every rank finished
    # (sync: end(); async: wait_save()), so `done` alone says complete.
    if not (path / "done").exists():
        return "no done marker (the save did not finish)"
    # Only the top of model/ and optim/: a 70B save holds many thousand tensor files.
    empty = _empty(path, "*.pt", "model/*.pt", "optim/*.pt")
    return f"empty file(s): {', '.join(empty)}" if empty else ""


def _nxd(path: Path) -> Verdict | None:
    step = nxd_step_of(path.name)
    # Any step_N directory could be anything; NxD's own markers say it is one of its saves.
    # (The legacy NxD <= 0.6 `newest` file is written before the data: never a marker.)
    if step is None or not ((path / "checkpoint").exists() or (path / "done").exists()):
        return None
    return _verdict("nxd", step, path, _nxd_problem(path))


def _nemo(path: Path) -> Verdict | None:
    m = _NEMO_STEP.search(path.name)
    # With NxD checkpoint IO the .ckpt is a directory (an NxD tag); a plain PTL file is not ours.
    if m is None or not path.name.endswith(".ckpt") or not path.is_dir():
        return None
    # NeMoModelCheckpoint.format_checkpoint_unfinished_marker_path: present while saving
    # and left behind by a crash, so it overrides `done`.
    marker = Path(str(path).removesuffix(".ckpt").removesuffix("-EMA") + "-unfinished")
    if marker.exists():
        why = f"{marker.name} marker present (the save is in progress or was cut short)"
    else:
        why = _nxd_problem(path)
    return _verdict("nemo", int(m.group(1)), path, why)


def _hf(path: Path) -> Verdict | None:
    m = _HF_DIR.match(path.name)
    if m is None or not path.is_dir():
        return None
    step = int(m.group(1))
    state_file = path / "trainer_state.json"
    # Trainer._save_checkpoint writes trainer_state.json after the model, optimizer,
    # scheduler and RNG states.
    if not state_file.is_file():
        return _verdict("hf", step, path, "no trainer_state.json (the save did not finish)")
    try:
        state = json.loads(user_files.read_text(state_file, _MARKER_MAX_BYTES))
    except (OSError, ValueError) as e:
        return _verdict("hf", step, path, f"trainer_state.json unreadable: {e}")
    if not isinstance(state, dict):
        return _verdict("hf", step, path, "trainer_state.json is not a JSON object")
    if "global_step" in state and state["global_step"] != step:
        return _verdict("hf", step, path, f"trainer_state.json names global_step {state['global_step']!r}")
    empty = _empty(path, "*.safetensors", "*.bin", "*.pt", "*.pth")
    return _verdict("hf", step, path, f"empty file(s): {', '.join(empty)}" if empty else "")


def _dcp_problem(path: Path) -> str:
    # FileSystemWriter.finish() writes .metadata.tmp and renames it after every rank's data.
    metadata = path / ".metadata"
    if metadata.is_file():
        if metadata.stat().st_size == 0:
            return "empty .metadata (the save did not finish)"
    elif (path / ".metadata.tmp").exists():
        return "only .metadata.tmp (the save was cut short while finishing)"
    else:
        return "no .metadata (the save did not finish)"
    empty = _empty(path, "*.distcp")
    return f"empty shard file(s): {', '.join(empty)}" if empty else ""


def _is_dcp(path: Path) -> bool:
    return (path / ".metadata").exists() or (path / ".metadata.tmp").exists() or any(path.glob("*.distcp"))


def _dcp(path: Path) -> Verdict | None:
    m = _DCP_DIR.match(path.name)
    # The names are generic, so the directory must hold DCP files to be claimed.
    if m is None or not path.is_dir() or not _is_dcp(path):
        return None
    return _verdict("dcp", int(m.group(1) or m.group(2)), path, _dcp_problem(path))


def _read_tracker(root: Path) -> _Tracker:
    try:
        text = user_files.read_text(root / _TRACKER, _MARKER_MAX_BYTES).strip()
    except FileNotFoundError:
        return f"no {_TRACKER} (no save has finished)"
    except (OSError, ValueError) as e:
        return f"{_TRACKER} unreadable: {e}"
    if text == "release":
        return 0, True
    if re.fullmatch(r"[0-9]+", text) is None:
        return f"{_TRACKER} holds {text[:40]!r}, not an iteration"
    return int(text), False


def _megatron_problem(path: Path) -> str:
    ranks = [d for d in path.glob("mp_rank_*") if d.is_dir()]  # mp_rank_TT[_PPP[_EEE]]
    if ranks:
        missing = sorted(d.name for d in ranks if not (d / "model_optim_rng.pt").is_file())
        if missing:
            return f"no model_optim_rng.pt in {', '.join(missing)}"
        empty = _empty(path, "mp_rank_*/*.pt")
        return f"empty file(s): {', '.join(empty)}" if empty else ""
    if _is_dcp(path):  # --ckpt-format torch_dist
        return _dcp_problem(path)
    return "neither mp_rank_*/model_optim_rng.pt nor .metadata (an empty iteration directory)"


def _megatron(path: Path, tracker: Callable[[], _Tracker]) -> Verdict | None:
    """``tracker`` reads the root's tracker file, only when ``path`` looks like Megatron's."""
    if path.name == "release":
        # A bare "release" directory is Megatron's only when the tracker says so.
        if tracker() != (0, True) or not path.is_dir():
            return None
        step = 0
    else:
        m = _ITER_DIR.match(path.name)
        if m is None or not path.is_dir():
            return None
        step = int(m.group(1))
    tracked = tracker()
    if isinstance(tracked, str):
        return _verdict("megatron", step, path, tracked)
    iteration, release = tracked
    # Rank 0 writes the tracker only after every rank saved (after the barrier, or in the
    # async finalize): a newer iteration is a save that did not finish, and the older ones
    # that still exist were each tracked in their turn.
    if step > iteration or (release and path.name != "release"):
        named = "release" if release else iteration
        return _verdict("megatron", step, path, f"newer than {_TRACKER} ({named}): the save did not finish")
    return _verdict("megatron", step, path, _megatron_problem(path))


def _lightning(path: Path) -> Verdict | None:
    m = _NEMO_STEP.search(path.name)
    if m is None or not path.name.endswith(".ckpt") or not path.is_file():
        return None
    return _verdict("lightning", int(m.group(1)), path, _zip_problem(path))


_ZIP_END = b"PK\x05\x06"  # the end of central directory record, written last


def _zip_problem(path: Path) -> str:
    """Why a torch.save file is not whole: its zip end record is missing (a save cut short)."""
    size = user_files.size_of(path)
    # the record, and a zip comment of at most 64 KiB
    tail = user_files.read_bytes(path, 65_557, offset=max(0, size - 65_557))
    return "" if _ZIP_END in tail else f"{path.name}: no zip end record (the save was cut short)"


_RECOGNISERS: dict[str, Callable[[Path], Verdict | None]] = {
    "tsup": _tsup, "nxd": _nxd, "nemo": _nemo, "hf": _hf, "dcp": _dcp, "lightning": _lightning,
}


def _layouts(layout: str | None) -> tuple[str, ...]:
    if layout is None:
        return LAYOUTS
    if layout not in LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return (layout,)


def _inspect(path: Path, layouts: tuple[str, ...], tracker: Callable[[], _Tracker]) -> Verdict | None:
    try:
        for name in layouts:
            v = _megatron(path, tracker) if name == "megatron" else _RECOGNISERS[name](path)
            if v is not None:
                # A checkpoint deleted while we looked reads as a failed save; it is none.
                # Every layout's checkpoint is a directory but Lightning's, a file.
                return v if path.is_dir() or (v.layout == "lightning" and path.is_file()) else None
    except FileNotFoundError:
        return None
    return None


def inspect(path: Path, layout: str | None = None) -> Verdict | None:
    """The verdict on one directory entry, or None when it is not a checkpoint (any more).

    ``layout`` restricts the layouts tried to that one; None tries all of ``LAYOUTS``.
    """
    return _inspect(path, _layouts(layout), functools.cache(lambda: _read_tracker(path.parent)))


def scan(directory: Path, layout: str | None = None, out_of_range: list[Path] | None = None) -> list[Verdict]:
    """Every checkpoint in ``directory``, newest first (an ok one first on a tie). One whose
    step is beyond ``MAX_STEP`` is left out (and added to ``out_of_range`` when given)."""
    layouts = _layouts(layout)
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    if "nemo" in layouts:
        entries += _per_job_entries(directory)
    # A link is never a checkpoint: the directory is its user's, the reader may be root.
    entries = [p for p in entries if not p.is_symlink()]
    tracker = functools.cache(lambda: _read_tracker(directory))  # read once per scan, if at all
    found = [v for p in entries if (v := _inspect(p, layouts, tracker)) is not None]
    if out_of_range is not None:
        out_of_range.extend(v.path for v in found if v.step > MAX_STEP)
    found = [v for v in found if v.step <= MAX_STEP]
    return sorted(found, key=lambda v: (v.step, v.ok, v.path.name), reverse=True)


def _per_job_entries(directory: Path) -> list[Path]:
    """Checkpoints in NxD Training's (NeMo exp_manager's) per-job directories below a
    checkpoint directory: <dir>/<name>/checkpoints/ and <dir>/<name>/<version>/checkpoints/."""
    out: list[Path] = []
    for pattern in ("*/checkpoints", "*/*/checkpoints"):
        for sub in directory.glob(pattern):
            parts = sub.relative_to(directory).parts
            if any((directory.joinpath(*parts[:i + 1])).is_symlink() for i in range(len(parts))):
                continue  # reached through a link: not the run's own directory
            if SET_ASIDE not in parts:
                with contextlib.suppress(OSError):
                    out.extend(sub.iterdir())
    return out


def pick(directory: Path, layout: str | None = None, before_step: int | None = None,
         exclude: Collection[int] = (), out_of_range: list[Path] | None = None,
         ) -> tuple[Verdict | None, list[Verdict]]:
    """The newest checkpoint that passes verification (older than ``before_step`` when
    given, and not at a step in ``exclude``), and the newer ones that failed."""
    return pick_from(scan(directory, layout, out_of_range), before_step, exclude)


def pick_from(found: list[Verdict], before_step: int | None = None, exclude: Collection[int] = (),
              ) -> tuple[Verdict | None, list[Verdict]]:
    """``pick`` among the verdicts of a scan already made (supervisor/runfiles/user_tree.py's)."""
    rejected: list[Verdict] = []
    for v in found:
        if (before_step is not None and v.step >= before_step) or v.step in exclude:
            continue
        if v.ok:
            return v, rejected
        rejected.append(v)
    return None, rejected
