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

import collections
import contextlib
import io
import os
import pickle
import re
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from trainer import checkpoint_layout as layout
from trainer import state_file
from wire.errors import CheckpointMismatch

_CHUNK = 64 << 20  # bytes read (and hashed) at a time
_BIG_COPY = 1 << 20  # a read of this many bytes or more is copied by torch, without the GIL


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
    """A read-only, seekable file over bytes in memory, copying nothing until read. Large
    reads (a tensor's bytes, as torch.load asks for them) are copied by torch, which lets
    go of the GIL: the restoring threads copy side by side."""

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
        if n >= _BIG_COPY:
            torch.frombuffer(out, dtype=torch.uint8, count=n).copy_(
                torch.frombuffer(self._data, dtype=torch.uint8, count=n, offset=self._pos))
        else:
            out[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def read_verified(path: Path, want: dict[str, Any] | None) -> bytes:
    """The whole (small) file, checked against its manifest entry ``want`` (None: the
    manifest does not list it) before it is returned; CheckpointMismatch when it differs."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointMismatch(f"{path.name}: {e.strerror or e}") from e
    verify_bytes(path, memoryview(data), want)
    return data


def verify_bytes(path: Path, data: memoryview, want: dict[str, Any] | None) -> None:
    """CheckpointMismatch unless ``data``, the bytes of ``path``, are what its manifest
    entry ``want`` says (hashed in pieces: the hash lets go of the GIL)."""
    if want is None:
        return
    algorithm = layout.entry_hash(want)[0]
    hasher = layout.new_hasher(algorithm)
    for at in range(0, len(data), _CHUNK):
        hasher.update(data[at:at + _CHUNK])
    problem = layout.entry_problem(path.name, want, {"size": len(data), algorithm: hasher.hexdigest()})
    if problem:
        raise CheckpointMismatch(f"{path.parent}: not what was written: {problem}")


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """A file's bytes, mapped (state_file.mapped), as a CheckpointMismatch when it cannot be."""
    try:
        if os.stat(path).st_size == 0:  # nothing to map
            yield memoryview(b"")
            return
        with state_file.mapped(path) as view:
            yield view
    except OSError as e:
        raise CheckpointMismatch(f"{path.name}: {e.strerror or e}") from e


# --- a torch.save'd tensor, in place ------------------------------------------------------


def tensor_in_place(record: memoryview) -> torch.Tensor | None:
    """The tensor that ``torch.save`` wrote as ``record``, as a view of the record's own
    bytes (nothing is copied); None unless the record is one plain tensor's, uncompressed
    and little-endian (the caller then loads it with torch.load).

    The record is a zip of a pickle naming the tensor's dtype, size, stride and storage,
    and the storage's bytes. The pickle is read by ``_Layout``, which knows only the names
    a plain tensor's pickle uses: anything else is not unpickled here."""
    try:
        with zipfile.ZipFile(_MemoryFile(record)) as z:
            records = {info.filename.split("/", 1)[-1]: info for info in z.infolist()}
            pickled = io.BytesIO(z.read(records["data.pkl"]))
            (dtype, key, numel), offset, size, stride = _Layout(pickled).load()
            byteorder = z.read(records["byteorder"]) if "byteorder" in records else b"little"
        storages = [name for name in records if name.startswith("data/")]
        data = records[f"data/{key}"]
        if storages != [f"data/{key}"] or data.compress_type != zipfile.ZIP_STORED or byteorder != b"little":
            return None
        name_len, extra_len = struct.unpack_from("<HH", record, data.header_offset + 26)
        start = data.header_offset + 30 + name_len + extra_len
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if data.file_size != numel * itemsize or start + data.file_size > len(record):
            return None
        flat = state_file.view(record, start, data.file_size)
        return flat.view(dtype).as_strided(size, stride, offset) if numel else torch.empty(size, dtype=dtype)
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError, TypeError, AttributeError,
            EOFError, RuntimeError, struct.error):
        return None


# The typed storage classes a pickle names, and their dtypes; the others (complex, float8)
# go through torch.load.
_STORAGE_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64,
                   "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
                   "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
                   "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool}


class _Layout(pickle.Unpickler):
    """Reads a ``torch.save``'d tensor's pickle for its layout alone: ((dtype, storage key,
    storage elements), storage offset, size, stride). Any name a plain tensor's pickle
    does not use is refused (UnpicklingError)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _layout_of
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch", "Size"):
            return tuple
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]  # a typed storage class's name: it names the dtype
        raise pickle.UnpicklingError(f"{module}.{name} is not in a plain tensor's pickle")

    def persistent_load(self, pid: Any) -> Any:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"persistent id {kind!r}")
        return dtype, str(key), int(numel)


def _layout_of(storage: Any, offset: int, size: Any, stride: Any, *_rest: Any) -> Any:
    return storage, int(offset), tuple(size), tuple(stride)


def _target(item: ReadItem, tensor: torch.Tensor, planner: LoadPlanner, lock: threading.Lock) -> torch.Tensor:
    """The live tensor ``item`` loads into, checked to be the size of what was saved."""
    with lock:
        target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CheckpointMismatch(f"{item.storage_index}: saved as {tuple(tensor.size())}, "
                                 f"this run's is {tuple(target.size())}")
    return target


def _narrowed(item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a saved chunk that ``item`` asks for (a resharded load reads a part)."""
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


class VerifyingReader(FileSystemReader):
    """DCP's reader with ``threads`` threads and the manifest's check (``manifest``: file
    name -> entry; None: a checkpoint written without one).

    Every file is verified by one rank (``verifier``: the rank that wrote it, as a rank of
    this world), which hashes it whole before using any of it: with the world size it was
    saved at, that is each rank's own files, which hold all it needs. Those files are
    mapped, not read into fresh memory (on a GPU node's restore of 18 GB, first-touch page
    faults of fresh buffers held the read to 0.7 GB/s): each is hashed from the mapping
    by a thread of its own, then its tensors are copied from the mapping straight into
    the live state by ``threads`` threads (state_file.copy_into: on a GPU through pinned
    buffers), each tensor found in its ``torch.save`` record without unpickling its data
    (``tensor_in_place``; anything else goes through ``torch.load``). The mapping is shared
    and read-only: the files are the run's own, written by its own user and committed
    before this attempt began.

    The bytes a rank needs from a file another rank verifies it reads alone, by range: a
    shared item (the optimizer's step count, kept once) does not make it read another
    rank's whole file. A file that differs fails the verifying rank, and with it every
    rank (DCP gathers their errors)."""

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
        if self.manifest is None:  # nothing to verify: each rank maps the files it needs
            mine = set(per_file)
        for name in mine:
            per_file.setdefault(name, [])
        if self.manifest is not None:
            unlisted = sorted(set(per_file) - set(self.manifest))
            if unlisted:
                raise CheckpointMismatch(f"{self.path}: {unlisted[0]} is not in its manifest")
        lock = threading.Lock()  # the planner's bookkeeping is not made for threads
        with contextlib.ExitStack() as mappings, \
                ThreadPoolExecutor(max_workers=max(1, self.threads), thread_name_prefix="ckpt-read") as pool:
            views = {name: mappings.enter_context(_mapped(Path(self.path) / name)) for name in sorted(mine)}

            def verify(name: str) -> int:
                want = None if self.manifest is None else self.manifest.get(name)
                verify_bytes(Path(self.path) / name, views[name], want)
                return len(views[name])

            def ranges(name: str, items: list[ReadItem]) -> int:
                path = Path(self.path) / name
                return self._read_ranges(path, sorted(items, key=self._offset), planner, lock)

            self.bytes_read = sum(_all(pool, verify, ((name,) for name in sorted(mine))))
            self.bytes_read += sum(_all(pool, ranges, ((name, items) for name, items in per_file.items()
                                                       if name not in mine)))
            self._load_verified({name: per_file[name] for name in mine}, views, planner, lock)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _load_verified(self, per_file: dict[str, list[ReadItem]], views: dict[str, memoryview],
                       planner: LoadPlanner, lock: threading.Lock) -> None:
        """Load the items of verified files from their mappings."""
        pairs: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        for name, items in per_file.items():
            for item in sorted(items, key=self._offset):
                info = self.storage_data[item.storage_index]
                blob = views[name][self._offset(item):self._offset(item) + int(info.length)]
                saved = (tensor_in_place(blob) if item.type != LoadItemType.BYTE_IO
                         and not info.transform_descriptors else None)
                if saved is None:  # bytes, a transformed record, or not a plain tensor's
                    self._load(item, blob, planner, lock)
                    continue
                tensor = _narrowed(item, saved)
                pairs.append((item, _target(item, tensor, planner, lock), tensor))
        flat = [(t, s) for _, t, s in pairs if t.is_contiguous() and s.is_contiguous()]
        state_file.copy_into(flat, threads=self.threads)
        for _, target, tensor in pairs:
            if not (target.is_contiguous() and tensor.is_contiguous()):
                target.copy_(tensor)
        for item, target, _ in pairs:
            planner.commit_tensor(item, target)
        pairs.clear()  # no view of a mapping outlives it
        flat.clear()

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
                    self._load(item, memoryview(data), planner, lock)
                    done += length
        except OSError as e:
            raise CheckpointMismatch(f"{path.name}: {e.strerror or e}") from e
        return done

    def _load(self, item: ReadItem, data: memoryview, planner: LoadPlanner, lock: threading.Lock) -> None:
        """Load ``item`` from ``data``, its record's bytes, through torch.load."""
        info = self.storage_data[item.storage_index]
        piece = _MemoryFile(data[:info.length])
        stream = self.transforms.transform_load_stream(item, info.transform_descriptors or (),
                                                       cast(IO[bytes], piece))
        if item.type == LoadItemType.BYTE_IO:
            with lock:
                planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            return
        loaded = cast(torch.Tensor, torch.load(stream, map_location="cpu", weights_only=True))
        tensor = _narrowed(item, loaded)
        target = _target(item, tensor, planner, lock)
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


def _all(pool: ThreadPoolExecutor, fn: Callable[..., int], items: Iterable[tuple[Any, ...]]) -> list[int]:
    """Every result, or the first error once every task has ended (none is left running)."""
    futures = [pool.submit(fn, *args) for args in items]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]
