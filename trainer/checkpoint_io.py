"""Persistent checkpoint I/O at the storage's pace: PyTorch DCP's file system writer and
reader, each rank's files written and read by several threads, and hashed on the way.

A DCP checkpoint holds each rank's shards in ``__<rank>_<k>.distcp`` files (one per writer
thread) and DCP's ``.metadata``, each tensor a ``torch.save`` record inside them, so any
DCP reader loads it (and reshards it to another world size). What this module adds:

- ``HashingWriter``: ``io_threads`` threads write a rank's shards into as many files, and
  each thread hashes its file's bytes as it writes them (BLAKE3: trainer/
  checkpoint_layout.py). The manifest's entries come from there: nothing is read back.
- ``VerifyingReader``: each file is verified by one rank, the one that wrote it, which
  reads it whole with one of ``io_threads`` threads, hashing it as it reads and checking
  it against the manifest before any of its tensors is used; then its tensors are loaded
  from memory. What a rank needs of another rank's files it reads by range. The check
  costs no second read, and a file that differs fails the load on every rank (DCP
  gathers the ranks' errors) with the manifest's words.

``io_threads`` defaults to the cores of the node shared out over its ranks, from 2 to 8:
one file per thread keeps a rank's writes and hashes in parallel without splitting its
state into many small files.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
import zlib
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from trainer import checkpoint_layout as layout
from trainer.errors import CheckpointMismatch

_CHUNK = 64 << 20  # bytes read (and hashed) at a time


def io_threads(local_world_size: int = 1, cores: int | None = None) -> int:
    """The node's cores shared out over its ranks, at least 2 and at most 8."""
    cores = cores or os.cpu_count() or 2
    return max(2, min(8, cores // max(1, local_world_size)))


# --- writing -------------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A file being written, hashed as it goes (DCP writes through this)."""

    def __init__(self, raw: io.BufferedWriter, algorithm: str) -> None:
        super().__init__()
        self._raw = raw
        self._hasher = layout.new_hasher(algorithm)
        self._algorithm = algorithm
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        written = self._raw.write(view)
        n = len(view) if written is None else written
        self._hasher.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._raw.close()  # flushes it
        super().close()

    def entry(self) -> dict[str, Any]:
        return {"size": self.size, self._algorithm: self._hasher.hexdigest()}


class _HashingFileSystem(FileSystem):
    """DCP's local file system, keeping the manifest entry of every file it writes."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.entries: dict[str, dict[str, Any]] = {}  # file name -> manifest entry
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path)
        with _HashingStream(cast(io.BufferedWriter, target.open(mode)), self.algorithm) as stream:
            yield stream
            entry = stream.entry()
        with self._lock:
            self.entries[target.name] = entry

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP writes .metadata under a temporary name first
        with self._lock:
            entry = self.entries.pop(Path(path).name, None)
            if entry is not None:
                self.entries[Path(new_path).name] = entry


class HashingWriter(FileSystemWriter):
    """DCP's writer with ``threads`` files per rank, each hashed while written: after the
    save, ``entries`` holds the manifest entries of the files this rank wrote."""

    def __init__(self, path: Path, *, threads: int) -> None:
        super().__init__(path, thread_count=threads, sync_files=True)
        self.fs: _HashingFileSystem = _HashingFileSystem(layout.hash_name())

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        return dict(self.fs.entries)


# --- reading -------------------------------------------------------------------------


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes in memory, copying nothing until read."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._data) - self._pos))
        out[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def read_verified(path: Path, want: dict[str, Any] | None) -> bytearray:
    """The whole file, read once in pieces that are hashed as they arrive; CheckpointMismatch
    when it differs from its manifest entry ``want`` (None: the manifest does not list it)."""
    algorithm = layout.entry_hash(want)[0] if want is not None else None
    hasher = layout.new_hasher(algorithm) if algorithm is not None else None
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            data = bytearray(size)
            view, done = memoryview(data), 0
            while done < size:
                n = f.readinto(view[done:done + _CHUNK])
                if not n:
                    break
                if hasher is not None:
                    hasher.update(view[done:done + n])
                done += n
    except OSError as e:
        raise CheckpointMismatch(f"{path.name}: {e.strerror or e}") from e
    if want is not None and algorithm is not None and hasher is not None:
        problem = layout.entry_problem(path.name, want, {"size": done, algorithm: hasher.hexdigest()})
        if problem:
            raise CheckpointMismatch(f"{path.parent}: not what was written: {problem}")
    return data if done == size else data[:done]


class VerifyingReader(FileSystemReader):
    """DCP's reader with ``threads`` threads and the manifest's check (``manifest``: file
    name -> entry; None: a checkpoint written without one).

    Every file is verified by one rank (``verifier``: the rank that wrote it, as a rank of
    this world), which reads it whole, hashing it as it reads, before using any of it:
    with the world size it was saved at, that is each rank's own files, which hold all it
    needs. The bytes a rank needs from a file another rank verifies it reads alone, by
    range: a shared item (the optimizer's step count, kept once) does not make it read
    another rank's whole file. A file that differs fails the verifying rank, and with it
    every rank (DCP gathers their errors)."""

    def __init__(self, path: Path, *, manifest: dict[str, dict[str, Any]] | None, threads: int,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(path)
        self.manifest = manifest
        self.threads = threads
        self.reader_rank, self.world_size = rank, world_size  # (DCP's own ``rank`` may be unset)
        self.bytes_read = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        mine = {name for name in (self.manifest or {})
                if name != ".metadata" and verifier(name, self.world_size) == self.reader_rank}
        for name in mine:
            per_file.setdefault(name, [])
        lock = threading.Lock()  # the planner's bookkeeping is not made for threads

        def one(relative_path: str, items: list[ReadItem]) -> int:
            path = Path(self.path) / relative_path
            if relative_path not in mine:  # another rank's to verify: only the bytes needed
                return self._read_ranges(path, sorted(items, key=self._offset), planner, lock)
            want = None if self.manifest is None else self.manifest.get(relative_path)
            data = memoryview(read_verified(path, want))
            for item in sorted(items, key=self._offset):
                self._load(item, data[self._offset(item):], planner, lock)
            return len(data)

        if self.manifest is not None:
            unlisted = sorted(set(per_file) - set(self.manifest))
            if unlisted:
                raise CheckpointMismatch(f"{self.path}: {unlisted[0]} is not in its manifest")
        with ThreadPoolExecutor(max_workers=max(1, self.threads), thread_name_prefix="ckpt-read") as pool:
            self.bytes_read = sum(_all(pool, one, per_file.items()))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _offset(self, item: ReadItem) -> int:
        return int(self.storage_data[item.storage_index].offset)

    def _read_ranges(self, path: Path, items: list[ReadItem], planner: LoadPlanner,
                     lock: threading.Lock) -> int:
        """Load ``items`` from ``path`` reading only their bytes; the bytes read."""
        done = 0
        try:
            with open(path, "rb", buffering=0) as f:
                for item in items:
                    length = int(self.storage_data[item.storage_index].length)
                    data = bytearray(length)
                    n = os.preadv(f.fileno(), [data], self._offset(item)) if length else 0
                    if n != length:
                        raise CheckpointMismatch(f"{path.name}: {n} bytes at {self._offset(item)}, "
                                                 f"expected {length}")
                    self._load(item, memoryview(data), planner, lock, at=0)
                    done += length
        except OSError as e:
            raise CheckpointMismatch(f"{path.name}: {e.strerror or e}") from e
        return done

    def _load(self, item: ReadItem, data: memoryview, planner: LoadPlanner, lock: threading.Lock, *,
              at: int = 0) -> None:
        """Load ``item`` from ``data``, which holds its bytes from ``at`` on."""
        info = self.storage_data[item.storage_index]
        piece = _MemoryFile(data[at:at + info.length])
        stream = self.transforms.transform_load_stream(item, info.transform_descriptors or (),
                                                       cast(IO[bytes], piece))
        if item.type == LoadItemType.BYTE_IO:
            with lock:
                planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            return
        tensor = cast(torch.Tensor, torch.load(stream, map_location="cpu", weights_only=True))
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            if length < tensor.size(dim):  # a resharded load reads a part of the saved chunk
                tensor = tensor.narrow(dim, start, length)
        with lock:
            target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointMismatch(f"{item.storage_index}: saved as {tuple(tensor.size())}, "
                                     f"this run's is {tuple(target.size())}")
        target.copy_(tensor)
        with lock:
            planner.commit_tensor(item, target)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.manifest is not None and ".metadata" in self.manifest:
            # DCP's index is a pickle: checked before it is unpickled.
            read_verified(Path(self.path) / ".metadata", self.manifest[".metadata"])
        return super().read_metadata(*args, **kwargs)


_WRITER = re.compile(r"__(\d+)_\d+\.distcp")


def verifier(name: str, world_size: int) -> int:
    """The rank that verifies the file ``name`` on restore: the one that wrote it (DCP names
    a rank's files ``__<rank>_<k>.distcp``), as a rank of a world of ``world_size``; any
    other file by its name's CRC."""
    match = _WRITER.fullmatch(name)
    return (int(match.group(1)) if match else zlib.crc32(name.encode())) % max(1, world_size)


def _all(pool: ThreadPoolExecutor, fn: Callable[[str, list[ReadItem]], int],
         items: Iterable[tuple[str, list[ReadItem]]]) -> list[int]:
    """Every result, or the first error once every task has ended (none is left running)."""
    futures = [pool.submit(fn, *args) for args in items]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]
