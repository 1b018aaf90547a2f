"""An attempt's log files, as an operator reads them (``supervisorctl logs``).

Every launcher writes an attempt's output into its log directory
(``<run_dir>/attempts/<N>/``): ``rank-<r>....log`` per rank, or with ``launch = "node"``
``node-<k>....log`` per node (its torchrun's or ``train.sh``'s output, the seeds'
``llama.out``). A rank's output is its own file where there is one, else its node's; a
node's is its own file, else its first rank's. The files are the run's user's: they are
opened as the output reader opens them (supervisor/user_files.py: a regular file, never
through a link), and read a piece at a time from an offset, so that a follower can
resume where it stopped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from supervisor import user_files
from supervisor.errors import Conflict, NotFound

CHUNK_MAX_BYTES = 1 << 20
_NAME = re.compile(r"^(rank|node)-0*(\d+)\b.*\.log$")


@dataclass(frozen=True, slots=True)
class Piece:
    file: str  # its name in the attempt's log directory
    offset: int
    data: bytes
    size: int  # the file's size when read


def pick(log_dir: Path, *, rank: int | None, node_index: int | None, ranks_per_node: int,
         base: Path | None = None, reader: user_files.Reader = user_files.HERE) -> str:
    """The name of the file holding ``rank``'s output, or the node's at ``node_index`` in
    the attempt (neither: rank 0's). NotFound when the attempt wrote none for it. ``base``:
    the trusted directory ``log_dir`` is reached from, no link below it followed;
    ``reader``: who reads (the run's user's worker, supervisor/runfiles/user_tree.py)."""
    try:
        names = reader.listdir(base, log_dir)
    except OSError:
        raise NotFound(f"no logs in {log_dir} (the attempt has not started, or its logs are gone)") from None
    files: dict[tuple[str, int], str] = {}
    for name in names:
        if (m := _NAME.match(name)) is not None:
            files.setdefault((m.group(1), int(m.group(2))), name)
    if node_index is not None:
        wanted = [("node", node_index), ("rank", node_index * ranks_per_node)]
        who = f"node {node_index}"
    else:
        r = rank or 0
        wanted = [("rank", r), ("node", r // ranks_per_node)]
        who = f"rank {r}"
    for key in wanted:
        if key in files:
            return files[key]
    have = ", ".join(sorted(files.values())[:10]) or "none"
    raise NotFound(f"no log of {who} in {log_dir} (its log files: {have})")


def read(log_dir: Path, name: str, offset: int, max_bytes: int, base: Path | None = None,
         reader: user_files.Reader = user_files.HERE) -> Piece:
    """At most ``max_bytes`` (and ``CHUNK_MAX_BYTES``) of the file from ``offset`` (``base``,
    ``reader``: as for ``pick``)."""
    path = log_dir / name
    try:
        size = reader.size_of(path, base=base)
        data = (reader.read_bytes(path, min(max_bytes, CHUNK_MAX_BYTES), base=base, offset=offset)
                if offset < size else b"")
    except FileNotFoundError:
        raise NotFound(f"{path} is gone") from None
    except OSError as e:  # a link or a special file planted in its place (user_files.UnsafePath)
        raise Conflict(f"{path} cannot be read: {e}") from e
    return Piece(file=name, offset=offset, data=data, size=size)
