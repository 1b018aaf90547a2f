"""One rank's training state as one flat file: the memory tier's format.

    TSUPST01 | header length (8 bytes, little-endian) | header (JSON) | padding | data

The header holds the trainer meta, the tree of the state (nested dicts, lists and tuples,
numbers and strings, each tensor a reference) and each tensor's dtype, shape and byte
range in the data, every range aligned to ``ALIGN`` bytes. Tensors are their raw bytes:
nothing is serialized, so

- a save is writes of the staged host buffers at their offsets, by several threads at
  once (``write``), into a file sized beforehand;
- a restore maps the file and views each tensor in place (``read``): no copy until the
  bytes go where they belong, and ``copy_into`` does that with several threads (into a
  GPU, through pinned buffers that a stream of each thread's moves to the device while
  the thread fills the next).

A file that does not start with the magic is the earlier format (``torch.save``), read
as such. The state is this run's own, in node memory, never a file from elsewhere: the
header is parsed as JSON, never unpickled.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"TSUPST01"
ALIGN = 4096  # every tensor's bytes start at a multiple of this (a page: any dtype's alignment)
_PIECE = 64 << 20  # bytes one thread writes, or copies, at a time
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


class StateFileError(ValueError):
    """A state file that does not hold what this format says."""


@dataclass(frozen=True, slots=True)
class _Slot:
    dtype: str
    shape: list[int]
    offset: int  # from the start of the data
    nbytes: int


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (a copy only if it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _encode(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree as JSON, each tensor replaced by {"t": its index in ``tensors``}."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return {"t": len(tensors) - 1}
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise StateFileError("a state dict with keys that are not strings")
        return {"d": {k: _encode(v, tensors) for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)):
        return {"l" if isinstance(tree, list) else "u": [_encode(v, tensors) for v in tree]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"v": tree}
    raise StateFileError(f"a state holding a {type(tree).__name__}, which this format does not store")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if "t" in node:
        return tensors[node["t"]]
    if "d" in node:
        return {k: _decode(v, tensors) for k, v in node["d"].items()}
    if "l" in node:
        return [_decode(v, tensors) for v in node["l"]]
    if "u" in node:
        return tuple(_decode(v, tensors) for v in node["u"])
    return node["v"]


def write(path: Path, meta: dict[str, Any], state: Any, *, threads: int) -> int:
    """Write ``state`` (host tensors) and ``meta`` to ``path``; returns the file's size."""
    tensors: list[torch.Tensor] = []
    tree = _encode(state, tensors)
    slots, end = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        slots.append(_Slot(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=end,
                           nbytes=nbytes))
        end += -(-nbytes // ALIGN) * ALIGN
    header = json.dumps({"meta": meta, "tree": tree, "tensors": [asdict(s) for s in slots]}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
    pieces = [(start + s.offset + a, _bytes_of(t)[a:a + _PIECE])
              for s, t in zip(slots, tensors, strict=True) for a in range(0, s.nbytes, _PIECE)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, start + end)
        os.pwrite(fd, MAGIC + struct.pack("<Q", len(header)) + header, 0)

        def put(piece: tuple[int, torch.Tensor]) -> None:
            at, data = piece
            view, done = memoryview(data.numpy()).cast("B"), 0  # type: ignore[arg-type]
            while done < len(view):
                done += os.pwrite(fd, view[done:], at + done)

        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="state-write") as pool:
            list(pool.map(put, pieces))
    finally:
        os.close(fd)
    return start + end


def read(data: memoryview) -> tuple[dict[str, Any], Any]:
    """(meta, state) of a state file's bytes, each tensor a view into ``data`` (writable
    memory: a private mapping, or a buffer received); StateFileError if it is not one."""
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise StateFileError("not a state file of this format")
    (length,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    try:
        header = json.loads(bytes(data[len(MAGIC) + 8:len(MAGIC) + 8 + length]))
        start = -(-(len(MAGIC) + 8 + length) // ALIGN) * ALIGN
        tensors = []
        for raw in header["tensors"]:
            slot = _Slot(**raw)
            if slot.dtype not in _DTYPES or start + slot.offset + slot.nbytes > len(data):
                raise StateFileError(f"a tensor of dtype {slot.dtype} at byte {slot.offset} that the file "
                                     f"does not hold")
            flat = view(data, start + slot.offset, slot.nbytes)
            tensors.append(flat.view(_DTYPES[slot.dtype]).reshape(slot.shape))
        return header["meta"], _decode(header["tree"], tensors)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise StateFileError(f"an unreadable state file: {type(e).__name__}: {e}") from e


def view(data: memoryview, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of ``data`` from ``offset``, as a uint8 tensor over them (no copy)."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only mapping: torch warns that it cannot be written
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset)


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[memoryview]:
    """A file's bytes, mapped read-only and shared with the page cache, for as long as
    the context lasts: reading copies nothing, and a fault maps many pages at once (a
    private mapping, which torch would take as writable, maps them one by one: 1.5 GB/s
    here against 7). ``read``'s tensors over it are only ever read from."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            view = memoryview(m)
            try:
                yield view
            finally:
                view.release()
        finally:
            with contextlib.suppress(BufferError):  # a tensor still viewing it: the GC closes it
                m.close()


# --- into the live state -----------------------------------------------------------------


def copy_into(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, threads: int) -> None:
    """Copy each (destination, source) pair, sources on the host, in pieces shared out over
    ``threads`` threads; a GPU destination through two pinned buffers per thread, each
    thread's stream moving one to the device while the thread fills the other."""
    pieces = [(dst, src, a) for dst, src in pairs
              for a in range(0, dst.numel(), max(1, _PIECE // max(1, dst.element_size())))]
    if not pieces:
        return
    shares = [pieces[i::max(1, threads)] for i in range(max(1, threads))]
    cuda = any(dst.device.type == "cuda" for dst, _ in pairs)
    with ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="state-copy") as pool:
        futures = [pool.submit(_to_device if cuda else _on_host, share) for share in shares if share]
        errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _count(dst: torch.Tensor, a: int) -> int:
    return min(max(1, _PIECE // max(1, dst.element_size())), dst.numel() - a)


def _on_host(pieces: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    for dst, src, a in pieces:
        n = _count(dst, a)
        dst.view(-1)[a:a + n].copy_(src.reshape(-1)[a:a + n])


def _to_device(pieces: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    device = pieces[0][0].device
    torch.cuda.set_device(device)  # a new thread's device is 0: its pinned buffers would make a context there
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    buffers = [torch.empty(_PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event(), torch.cuda.Event()]  # type: ignore[no-untyped-call]
    for i, (dst, src, a) in enumerate(pieces):
        n = _count(dst, a)
        k = i % 2
        done[k].synchronize()  # the copy that last read this buffer has finished
        staged = buffers[k][:n * dst.element_size()].view(dst.dtype)
        staged.copy_(src.reshape(-1)[a:a + n])
        with torch.cuda.stream(stream):
            dst.view(-1)[a:a + n].copy_(staged, non_blocking=True)
            done[k].record(stream)
    stream.synchronize()
