"""Host copies of a rank's training state for saves that run beside training.

A save beside training (an asynchronous persistent checkpoint, a memory-tier save) needs
the state as it was after one step while the next steps change it. What makes the copy
cheap for training:

- its host buffers are allocated once per run and reused by every save: a fresh buffer
  costs its page faults each time (1.85 GB/s on this project's CPU machine against 10 GB/s
  into buffers already touched), and pinning one for a GPU's DMA costs more;
- they are allocated (and touched, and on a GPU pinned) ahead of the first save, on a
  thread of their own (``prepare``), so no save pays for it. Each buffer's pages are
  touched before it is pinned: pinning fresh memory faults its pages in while holding the
  CUDA driver's lock, which stalls the training thread's next CUDA call (on an H200 the
  second step of a run took 17.5 s while 36 GB of fresh buffers were pinned);
- the copy runs beside the next step's forward and backward passes, which read the
  parameters and the optimizer's state but do not change them: on a GPU one non-blocking
  device-to-host copy per tensor into pinned memory, on a stream of its own ordered after
  the step that produced the state; on a CPU, on a thread of its own. Only the next
  optimizer step changes what is being copied: it waits for the copy (``StagedCopy.fence``;
  on a GPU the wait is the device's, the host does not block). Training is blocked for
  whatever of the copy is left by then, and nothing else.

The copies keep each tensor's kind: a DTensor stays a DTensor (its local shard on the
host), which is what DCP plans a sharded save from. PyTorch's own ``StateDictStager``
(the one ``torch.distributed.checkpoint.async_save`` uses) does the copying, caching each
host buffer by the storage it copies from.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.tensor import DTensor

from trainer.checkpoint import map_tensors

# How long a save's writer waits to learn what its copy cost training (the next optimizer
# step's fence) before it reports what it knows.
FENCE_WAIT_S = 600.0
_TOUCH_PIECE = 256 << 20  # bytes of a buffer one thread touches at a time, laying it out


class StagedCopy:
    """One copy in flight: ``state`` holds it once ``done``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state: Any = None
        self.begun_s = 0.0  # the training thread's time to start the copy
        self.copied = threading.Event()  # the copy is issued (on a GPU) or made (elsewhere)
        self.copy_event: Any = None  # on a GPU: the copy's end in its stream
        self.error: BaseException | None = None
        self._fenced = threading.Event()
        self._waited_s = 0.0  # what the fence waited for
        self._fence_event: Any = None  # on a GPU: the fence's place in training's stream

    def done(self) -> Any:
        """Wait for the copy to be complete (a writer, before it reads ``state``)."""
        self.copied.wait()
        if self.error is not None:
            raise self.error
        if self.copy_event is not None:
            self.copy_event.synchronize()
        return self.state

    def fence(self) -> None:
        """Training is about to change the state: the copy must be done first. On a GPU the
        optimizer's kernels wait for it in the device's stream; elsewhere the caller waits."""
        if self._fenced.is_set():
            return
        started = time.perf_counter()
        self.copied.wait()
        if self.copy_event is not None:
            stream = torch.cuda.current_stream(self.device)
            self._fence_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._fence_event.record(stream)
            stream.wait_event(self.copy_event)
        self._waited_s = time.perf_counter() - started
        self._fenced.set()

    def blocked_s(self, timeout_s: float = FENCE_WAIT_S) -> float:
        """What the copy cost training, once it was fenced: starting it, and the wait at the
        fence (on a GPU, how long the optimizer's kernels waited in the device's stream)."""
        self._fenced.wait(timeout_s)
        blocked = self.begun_s + self._waited_s
        if self._fence_event is not None and self.copy_event is not None:
            self.copy_event.synchronize()
            self._fence_event.synchronize()
            blocked += max(0.0, self._fence_event.elapsed_time(self.copy_event) / 1000.0)
        return blocked


class Staging:
    """One kind of save's host copy of this rank's state (a tier each: their copies are
    read by their own background writers, so they cannot share one)."""

    def __init__(self, device: torch.device, *, threads: int = 2) -> None:
        self.device = device
        self.threads = threads  # that touch the buffers' pages when they are laid out
        cuda = device.type == "cuda"
        self._stager = StateDictStager(pin_memory=cuda, share_memory=False)
        self._stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()  # one copy at a time: prepare's, then the saves'

    def prepare(self, state: Any) -> threading.Thread:
        """Allocate the buffers for ``state`` (views of the live tensors, built on the
        training thread) by a first copy on a thread of its own, never fenced: its content
        is not kept, only its buffers (on a GPU, allocating and pinning them takes seconds,
        which no save should wait for; the first ``begin`` waits only if it comes sooner)."""
        def run() -> None:
            if self._stream is not None:
                torch.cuda.set_device(self.device)  # a new thread's device is 0
            with self._lock:
                self.lay_out(state)
            self.begin(state).done()

        thread = threading.Thread(target=run, name="staging-prepare", daemon=True)
        thread.start()
        return thread

    def lay_out(self, state: Any) -> None:
        """A host buffer for each storage of ``state``, its pages touched, then (on a GPU)
        pinned, handed to the stager, which copies into it from then on. Touching first
        keeps the page faults out of the driver's lock: pinning pages already there holds
        it for much less. (Where the stager keeps no such cache, its first copy lays them
        out itself.)"""
        cache = getattr(self._stager, "_cached_storage_mapping", None)
        if cache is None:
            return
        pin = self._stream is not None and getattr(self._stager, "pin_memory", False)
        min_pinned = getattr(self._stager, "pin_memory_min_bytes", 5)
        for storage in _storages(state):
            if storage in cache or storage.nbytes() == 0:
                continue
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")  # type: ignore[no-untyped-call]
            _touch(torch.empty(0, dtype=torch.uint8).set_(host), self.threads)  # the page faults, here
            if pin and host.nbytes() >= min_pinned:
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                status = int(cudart.cudaHostRegister(host.data_ptr(), host.nbytes(), 1))  # portable
                if status != 0:
                    raise RuntimeError(f"pinning {host.nbytes()} bytes of staging failed: cudaError {status}")
                unpin = weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())
                unpin.atexit = False  # not after the CUDA context is gone
            cache[storage] = host

    def begin(self, state: Any) -> StagedCopy:
        """Start copying ``state`` into this staging's host buffers; the copy is valid until
        the next ``begin``, and the caller must ``fence`` it before changing ``state``."""
        started = time.perf_counter()
        copy = StagedCopy(self.device)
        if self._stream is None:
            self._lock.acquire()  # released by the copying thread
            threading.Thread(target=self._copy_on_host, args=(copy, state), name="staging",
                             daemon=True).start()
        else:
            with self._lock:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the step's kernels
                with torch.cuda.stream(self._stream):
                    copy.state = self._stager.stage(state, non_blocking=True)
                    copy.copy_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    copy.copy_event.record(self._stream)
            copy.copied.set()
        copy.begun_s = time.perf_counter() - started
        return copy

    @torch.no_grad()
    def _copy_on_host(self, copy: StagedCopy, state: Any) -> None:
        try:
            copy.state = self._stager.stage(state)
        except BaseException as e:  # the writer raises it
            copy.error = e
        finally:
            self._lock.release()
            copy.copied.set()

    def stage(self, state: Any) -> Any:
        """``state`` copied, now (``begin``, then waiting for it)."""
        copy = self.begin(state)
        copy.fence()
        return copy.done()

    def close(self) -> None:
        """Give the buffers back (a pinned buffer is unpinned once freed)."""
        with self._lock:
            self._stager.close()  # type: ignore[no-untyped-call]


def _touch(buffer: torch.Tensor, threads: int) -> None:
    """Fault in every page of ``buffer`` (bytes), ``threads`` pieces at a time: a fresh
    page's first write is what costs (2.4 GB/s on one thread here, 4.7 on two; on an H200
    node 36 GB took 17 s on one)."""
    piece = _TOUCH_PIECE
    starts = range(0, buffer.numel(), piece)
    if threads <= 1 or len(starts) == 1:
        buffer.fill_(0)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="staging-touch") as pool:
        list(pool.map(lambda a: buffer[a:a + piece].fill_(0), starts))


def _storages(state: Any) -> list[torch.UntypedStorage]:
    """The storages of every tensor in ``state`` (a DTensor's local shard's), each once."""
    found: dict[int, torch.UntypedStorage] = {}

    def note(t: torch.Tensor) -> None:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.data_ptr() != 0:
            storage = local.untyped_storage()
            found.setdefault(id(storage), storage)

    map_tensors(state, note)
    return list(found.values())
