"""A simulated accelerator: runs the executor's CUDA branch on CPU, for tests.

Stand-ins (patched in for one test) for exactly the ``torch.cuda`` pieces the executor and the
meter use: streams (``Stream``, ``current_stream``, ``stream(...)``), events (record, wait,
query, synchronize, elapsed_time), ``cudart()`` host registration, memory statistics, and the
tensor methods ``record_stream``, ``is_pinned`` and ``pin_memory``. "Device" tensors are CPU
tensors the simulator tracks (the executor's placement seam maps the device to the CPU).

What it checks, with the happens-before order of the streams (vector clocks, like
``TORCH_CUDA_SANITIZER``, but over byte ranges of storages, so views into one flat buffer count):

* the compute (default) stream runs each operator at once; copies issued on any other stream
  (``copy_``, ``.to(..., copy=True)``, dtype casts) are DEFERRED until something orders them
  (an event wait, a synchronize), so reading a slot too early reads stale bytes (NaN-filled);
* a read of bytes before the write to them is ordered, a write over bytes another stream may
  still read, a write racing another write;
* a device block freed while another stream may still use it (unless ``record_stream`` told the
  allocator);
* a host buffer unregistered while a copy may read it; a registration left on a freed buffer;
* a failed runtime call's pending error: the next device operator raises, as CUDA's does;
* wrapper tensor subclasses (comfy-kitchen's ``QuantizedTensor``): their own dispatch runs with
  the simulator on, so what it does to its inner tensors (a ``detach`` that clones the scales,
  a dequantize) is ordered, checked and allocated like any other operator;
* several devices (``simulated_cuda(monkeypatch, devices=2)``): a compute stream and an allocator
  per device; an operator runs on the stream of the device its tensors are on; every call that
  names no device (``current_stream()``, ``Event.record()``, ``empty_cache()``) is recorded in
  ``sim.device_calls`` with the device it resolved to, the current one.

Durations (``sim.set_durations(copy_bytes_per_s=..., op_seconds=...)``): a virtual clock per
stream. A copy from host memory takes ``copy_latency_s`` plus its bytes over ``copy_bytes_per_s``, a copy
from another device (a peer copy) ``peer_latency_s`` plus its bytes over ``peer_bytes_per_s``, an operator
``op_seconds(func, args, kwargs, out)`` seconds (``flop_seconds(flops_per_s)``: torch's FLOP count
of the operator over a throughput), and each executor call ``call_host_s`` of host work before it
issues anything (the executor's own cost of a call: the simulator's host is otherwise instant);
work on a stream starts when the stream's earlier work is done,
after every event it waits for, and not before the host last saw the time (a synchronize, an event
it queried as complete). Events carry the time they complete at, so ``elapsed_time`` and the
executor's measured times show what overlapped. The host issues work ahead of the device: its time
moves only where it waits or observes. ``query()`` says complete only once the compute stream of
the event's device has reached the event's time (the host keeps pace with compute, which runs
eagerly here). Without durations, events are stamped with wall time as before.

Threads: the disk reader (``disk.reader()``) is ``SimReader`` while the simulator is on, one
thread running jobs in order with the simulator's dispatch mode on. Each thread has its own view
(``_ThreadView``): its virtual time, the stream positions it has waited for, its current streams;
a job starts having seen what its submitter had, and the host that waits for a job
(``result()``, ``exception()``) sees what the job saw and moves to when it ended
(``sim.read_waits`` counts the joins that made the host wait). The bookkeeping is under one lock,
and the checks are as strict as with one thread: an access is ordered only by what its own thread
has seen. ``set_durations(disk_bytes_per_s=...)``: a disk read (``disk.read_into``, a CPU write
into host memory, checked like one) takes its bytes over that rate on one reader lane, from when
its thread issues it and the lane is free (``sim.disk_reads``), and a copy from the buffer it
filled cannot start before it is done.

Host-blocking waits are counted (``sim.host_syncs``; the reader's in ``sim.reader_syncs``), and so are ``empty_cache`` calls
(``sim.empty_cache_calls``), a device-wide synchronisation under ``cudaMallocAsync``.

Hazards are collected in ``sim.hazards`` (finalizers cannot raise); the fixture fails the test
on any. Memory statistics come from a counting allocator with per-stream pools, block splitting
and coalescing, so ``memory_reserved`` differs from ``memory_allocated`` the way it does on a GPU
(cached blocks, the copy stream's pool) until ``empty_cache``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import importlib
import itertools
import queue
import threading
import time
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# torch's CUDA caching allocator's rounding (c10/cuda/CUDACachingAllocator.cpp): every block a
# multiple of kMinBlockSize; a request of kMinLargeAlloc or more gets a segment of its own rounded
# up to kRoundLarge, handed out whole unless what is left is more than kSmallSize (large blocks
# split only then). The 2 MiB / 20 MiB segments smaller requests share are not modelled (the
# pools here grow as arenas); bench/gpu_check.py measures the real allocator.
ROUND = 512                  # kMinBlockSize
SMALL_SIZE = 1 << 20         # kSmallSize
MIN_LARGE_ALLOC = 10 << 20   # kMinLargeAlloc
ROUND_LARGE = 2 << 20        # kRoundLarge
NAN_FILL = 0xFF  # fresh device memory: bytes that read as NaN in float views

ERR_MEMORY_ALLOCATION = 2           # cudaErrorMemoryAllocation
ERR_HOST_MEMORY_ALREADY_REGISTERED = 712
ERR_HOST_MEMORY_NOT_REGISTERED = 713


class PendingCudaError(RuntimeError):
    pass


def _locked(fn):
    """Run under the simulator's lock: its bookkeeping is shared by the host thread and the
    disk reader's (``SimReader``)."""
    @functools.wraps(fn)
    def run(self, *a, **k):
        sim = self if isinstance(self, SimCuda) else getattr(self, "sim", None) or SimCuda.active
        if sim is None:
            return fn(self, *a, **k)
        with sim.lock:
            return fn(self, *a, **k)
    return run


# -- allocator --------------------------------------------------------------------------------

class _Block:
    __slots__ = ("seg", "off", "size", "free", "prev")

    def __init__(self, seg, off, size, free=False):
        self.seg, self.off, self.size, self.free = seg, off, size, free
        self.prev: list = []   # (stream id, position) of other streams' uses when it was freed


class _Segment:
    """One stream's pool: an arena that grows at its end (the real allocator's large segments
    and expandable segments coalesce the same way)."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id, self.size = stream_id, 0
        self.blocks: list[_Block] = []


class SimAllocator:
    """Caching allocator model: a pool per stream, best fit, split and coalesce, cached until
    ``empty_cache``. Sizes round as torch's allocator rounds them (``ROUND`` and the large-block
    rules above). ``on_reuse(stream_id, block)`` is called
    when freed memory is handed out again (the simulator checks it is safe)."""

    def __init__(self, on_reuse=None) -> None:
        self.pools: dict[int, _Segment] = {}
        self.allocated = self.reserved = 0
        self.max_allocated = self.max_reserved = 0
        self.at_peak = ""
        self.at_peak_blocks = 0
        self.on_reuse = on_reuse
        self.high_allocated = 0          # like max_allocated, but never reset by the code under test
        self.cap: int | None = None      # set_per_process_memory_fraction x total memory
        self.ooms = 0

    @property
    def segments(self):
        return list(self.pools.values())

    def alloc(self, n: int, stream_id: int) -> _Block | None:
        # a garbage collection inside would run storages' finalizers (``free``) on the blocks
        # being split: none while the pools are walked
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._alloc(n, stream_id)
        finally:
            if enabled:
                gc.enable()

    def _alloc(self, n: int, stream_id: int) -> _Block | None:
        if n <= 0:
            return None
        n = (n + ROUND - 1) // ROUND * ROUND
        seg = self.pools.setdefault(stream_id, _Segment(stream_id))
        best = None
        for b in seg.blocks:
            if b.free and b.size >= n and (best is None or b.size < best.size):
                best = b
        if best is None and n >= MIN_LARGE_ALLOC:   # a segment of its own, rounded
            best = self._grow(seg, -(-n // ROUND_LARGE) * ROUND_LARGE, n, fresh=True)
        if best is None:
            best = self._grow(seg, n, n)
        if best.prev and self.on_reuse is not None:
            self.on_reuse(stream_id, best)
        rest_min = SMALL_SIZE + 1 if n > SMALL_SIZE else ROUND   # torch's should_split
        if best.size - n >= rest_min:
            rest = _Block(seg, best.off + n, best.size - n, True)
            rest.prev = list(best.prev)
            seg.blocks.insert(seg.blocks.index(best) + 1, rest)
            best.size = n
        best.free = False
        best.prev = []
        self.allocated += best.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.high_allocated = max(self.high_allocated, self.allocated)
        if self.reserved > self.max_reserved:
            self.max_reserved = self.reserved
            self.at_peak = self.describe()
            self.at_peak_blocks = sum(not b.free for seg in self.pools.values() for b in seg.blocks)
        return best

    def _grow(self, seg: "_Segment", size: int, n: int, fresh: bool = False) -> "_Block":
        """Reserve more for a request of ``n`` B: the pool's free tail grown to ``size`` B (or,
        ``fresh``, a new block of ``size`` B after it)."""
        def tail():
            return None if fresh else (seg.blocks[-1] if seg.blocks and seg.blocks[-1].free else None)

        last = tail()
        grow = size - (last.size if last else 0)
        if self.cap is not None and self.reserved + grow > self.cap:
            # as the caching allocator does: give back cached blocks, then fail
            self.empty_cache()
            last = tail()
            grow = size - (last.size if last else 0)
            if self.reserved + grow > self.cap:
                self.ooms += 1
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (simulated). Tried to allocate {n} B; {self.reserved} B reserved "
                    f"of the {self.cap} B this process is allowed (set_per_process_memory_fraction)")
        if last is None:
            last = _Block(seg, seg.size, 0, True)
            seg.blocks.append(last)
        last.size += grow
        seg.size += grow
        self.reserved += grow
        return last

    def describe(self) -> str:
        """Pools by stream: reserved, and the blocks in use (for a failure message)."""
        out = []
        for seg in self.pools.values():
            used = [b.size for b in seg.blocks if not b.free]
            out.append(f"stream {seg.stream_id}: {seg.size} B, used {used}")
        return f"allocated {self.allocated}, reserved {self.reserved}: " + "; ".join(out)

    def free(self, b: _Block, prev: list) -> None:
        b.free = True
        b.prev = list(prev)
        self.allocated -= b.size
        blocks = b.seg.blocks
        i = blocks.index(b)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            nxt = blocks.pop(i + 1)
            b.size += nxt.size
            b.prev += nxt.prev
        if i > 0 and blocks[i - 1].free:
            blocks[i - 1].size += b.size
            blocks[i - 1].prev += b.prev
            blocks.pop(i)

    def empty_cache(self) -> None:
        """Give back the free memory at the end of each pool (what nothing in use pins)."""
        for seg in self.pools.values():
            while seg.blocks and seg.blocks[-1].free:
                b = seg.blocks.pop()
                seg.size -= b.size
                self.reserved -= b.size

    def reset_peak(self) -> None:
        self.max_allocated, self.max_reserved = self.allocated, self.reserved


# -- streams and events -----------------------------------------------------------------------

class SimStream:
    def __init__(self, device=None, priority: int = 0, *, sim: "SimCuda | None" = None, eager=False) -> None:
        self.sim = sim or SimCuda.active
        self.id = next(self.sim._ids)
        self.clock: dict[int, int] = {self.id: 0}
        self.queue: list = []        # deferred work: ("op", pos, fn) and ("wait", stream, pos)
        self.done = 0                 # position executed up to
        self.t = 0.0                  # virtual time its issued work ends at (``SimCuda.set_durations``)
        self.eager = eager
        self.device = device
        self.dev = self.sim.device_index(device, "Stream()")
        self.sim.streams.append(self)

    @property
    def pos(self) -> int:
        return self.clock[self.id]

    def issue(self) -> int:
        self.clock[self.id] += 1
        if self.eager:
            self.done = self.clock[self.id]
        return self.clock[self.id]

    @_locked
    def wait_event(self, ev: "SimEvent") -> None:
        self.sim.wait(self, ev)

    def wait_stream(self, other: "SimStream") -> None:
        ev = SimEvent()
        ev.record(other)
        self.wait_event(ev)

    def record_event(self, ev: "SimEvent | None" = None) -> "SimEvent":
        ev = ev or SimEvent()
        ev.record(self)
        return ev

    @_locked
    def synchronize(self) -> None:
        self.sim.synced()
        self.sim.flush(self)
        self.sim.host_observes(self.clock)
        self.sim.host_t = max(self.sim.host_t, self.t)

    def run_for(self, seconds: float) -> None:
        """Virtual time: work of ``seconds`` issued now on this stream."""
        self.t = max(self.t, self.sim.host_t) + seconds

    def query(self) -> bool:
        return not self.queue

    def __enter__(self):
        self.sim.stack.append(self)
        return self

    def __exit__(self, *exc):
        self.sim.stack.pop()

    def __repr__(self) -> str:
        return f"SimStream({self.id}{', compute' if self.eager else ''}{f', cuda:{self.dev}' if self.dev else ''})"


class SimEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.stream: SimStream | None = None
        self.pos = 0
        self.clock: dict[int, int] = {}
        self.t = 0.0

    @_locked
    def record(self, stream: SimStream | None = None) -> None:
        sim = SimCuda.active
        stream = stream or sim.current_stream(None, "Event.record()")
        self.stream, self.pos, self.clock = stream, stream.pos, dict(stream.clock)
        self.t = max(stream.t, sim.host_t) if sim.timed else time.perf_counter()

    def wait(self, stream: SimStream | None = None) -> None:
        (stream or SimCuda.active.current()).wait_event(self)

    @_locked
    def query(self) -> bool:
        if self.stream is None:
            return True
        sim = self.stream.sim
        if sim.query_completes:
            sim.flush(self.stream, self.pos)
        done = self.stream.done >= self.pos
        if done and sim.timed:
            done = self.t <= sim.computes[self.stream.dev].t + 1e-12   # the host keeps pace with compute
            if done:
                sim.host_t = max(sim.host_t, self.t)
        if done:
            sim.host_observes(self.clock)
        return done

    @_locked
    def synchronize(self) -> None:
        if self.stream is None:
            return
        self.stream.sim.synced()
        self.stream.sim.flush(self.stream, self.pos)
        self.stream.sim.host_observes(self.clock)
        self.stream.sim.host_t = max(self.stream.sim.host_t, self.t)

    def elapsed_time(self, end: "SimEvent") -> float:
        if self.stream is not None and end.stream is not None and self.stream.dev != end.stream.dev:
            raise RuntimeError("CUDA error: invalid resource handle (events recorded on different devices)")
        return max(0.0, (end.t - self.t) * 1e3)


def flop_seconds(flops_per_s: float):
    """``op_seconds`` for ``SimCuda.set_durations``: an operator takes torch's FLOP count of it
    (``torch.utils.flop_counter``'s registry, as the dry run counts) over ``flops_per_s``."""
    from torch.utils.flop_counter import flop_registry

    def seconds(func, args, kwargs, out) -> float:
        count = flop_registry.get(func._overloadpacket)
        return 0.0 if count is None else count(*args, **kwargs, out_val=out) / flops_per_s
    return seconds


# -- tracked storages -------------------------------------------------------------------------

class _Rec:
    """A storage the simulator tracks: device memory, or a host buffer it was told about."""

    def __init__(self, base: int, nbytes: int, host: bool, stream_id: int, block=None) -> None:
        self.base, self.nbytes, self.host, self.stream_id, self.block = base, nbytes, host, stream_id, block
        self.acc: dict[tuple, int] = {}    # (stream id, is_write, lo, hi) -> position
        self.recorded: set[int] = set()    # streams named by record_stream
        self.torch_pinned = False          # from torch's host allocator (pin_memory)
        self.alive = True
        self.dev = 0                       # the simulated device it lives on


def _extent(t: torch.Tensor) -> tuple[int, int]:
    base = t.untyped_storage().data_ptr()
    lo = t.data_ptr() - base
    if t.numel() == 0:
        return lo, lo
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return lo, lo + span * t.element_size()


class _CudaRT:
    """``torch.cuda.cudart()``: host registration, with injectable failures."""

    def __init__(self, sim: "SimCuda") -> None:
        self.sim = sim

    @_locked
    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        sim = self.sim
        sim.register_calls.append((ptr, size, flags))
        err = sim.register_error(ptr, size) if sim.register_error else 0
        if not err and ptr in sim.registered:
            err = ERR_HOST_MEMORY_ALREADY_REGISTERED
        if err:
            sim.pending_error = err
            return err
        sim.registered[ptr] = (size, flags)
        return 0

    @_locked
    def cudaHostUnregister(self, ptr: int) -> int:
        sim = self.sim
        if ptr not in sim.registered:
            sim.pending_error = ERR_HOST_MEMORY_NOT_REGISTERED
            return ERR_HOST_MEMORY_NOT_REGISTERED
        rec = sim.recs.get(ptr)
        if rec is not None:
            sim._check_host_quiet(rec, "host buffer unregistered while a copy may read it")
        del sim.registered[ptr]
        return 0


# -- threads ----------------------------------------------------------------------------------

class _ThreadView:
    """What one thread has seen: its virtual time, the positions of each stream it has waited
    for (work it can no longer race), the streams it has made current, its host-memory context."""

    def __init__(self, compute: "SimStream") -> None:
        self.t = 0.0
        self.clock: dict[int, int] = {}
        self.stack: list = [compute]
        self.ctx = 0


class _SimFuture(concurrent.futures.Future):
    """A job's future: the thread that waits for it (``result``, ``exception``) has seen what
    the job saw (its clock) and, timed, its time moves to when the job ended."""

    end_t = 0.0
    end_clock: dict = {}
    sim: "SimCuda | None" = None

    def _joined(self) -> None:
        sim = self.sim
        if sim is None or threading.current_thread() is not sim.main:
            return
        with sim.lock:
            if self.end_t > sim.host_t + 1e-15:
                sim.read_waits += 1
            sim.host_t = max(sim.host_t, self.end_t)
            sim.host_observes(self.end_clock)

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:
            self._joined()

    def exception(self, timeout=None):
        e = super().exception(timeout)
        self._joined()
        return e


class SimReader:
    """The disk reader thread (``disk.reader()``) while the simulator is on: one thread, jobs in
    the order they were submitted, the simulator's dispatch mode on in it. A job starts having
    seen what its submitter had (clock, virtual time) and its lane's own past; its waits and
    reads move its virtual time, not the host's, until the host waits for the job."""

    def __init__(self, sim: "SimCuda") -> None:
        self.sim = sim
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="vramcut-disk-sim", daemon=True)
        self.thread.start()

    def submit(self, fn, *args, **kwargs) -> _SimFuture:
        sim = self.sim
        fut = _SimFuture()
        fut.sim = sim
        with sim.lock:
            self.jobs.put((fut, fn, args, kwargs, sim.host_t, dict(sim.host_clock)))
        return fut

    def _run(self) -> None:
        sim = self.sim
        with _SimMode(sim):
            while True:
                item = self.jobs.get()
                if item is None:
                    return
                fut, fn, args, kwargs, t, clock = item
                with sim.lock:
                    sim.host_t = max(sim.host_t, t)
                    sim.host_observes(clock)
                try:
                    out = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001  (handed to the future, as a pool does)
                    self._end(fut)
                    fut.set_exception(e)
                else:
                    self._end(fut)
                    fut.set_result(out)
                # the job's arguments go now, as a pool's work item does (not at the next job)
                del item, fut, fn, args, kwargs
                out = e = None

    def _end(self, fut: _SimFuture) -> None:
        with self.sim.lock:
            fut.end_t, fut.end_clock = self.sim.host_t, dict(self.sim.host_clock)

    def shutdown(self, wait: bool = True) -> None:
        self.jobs.put(None)
        if wait:
            self.thread.join()


# -- the simulator ----------------------------------------------------------------------------

class SimCuda:
    active: "SimCuda | None" = None

    def __init__(self, devices: int = 1) -> None:
        self._ids = itertools.count()
        self.n_devices = devices
        self.current_device = 0
        self.device_calls: list[tuple[str, int]] = []   # calls that named no device: (what, device used)
        self.empty_cache_calls = 0
        self.fraction_calls: list[float] = []
        self.streams: list[SimStream] = []
        self.hazards: list[str] = []
        self.recorded_types: list[str] = []  # the type of every tensor record_stream was called on
        self.alloc = SimAllocator(self._reused)
        self.recs: dict[int, _Rec] = {}
        self.registered: dict[int, tuple[int, int]] = {}
        self.register_calls: list[tuple[int, int, int]] = []
        self.register_error = None        # callable(ptr, size) -> CUDA error code (0: success)
        self.pin_memory_fails = False
        self.pending_error: int | None = None
        self.query_completes = False      # event.query() finishes the work (a fast GPU)
        self.timed = False                # durations on (``set_durations``): virtual clocks
        self.copy_bytes_per_s: float | None = None
        self.copy_latency_s = 0.0
        self.peer_bytes_per_s: float | None = None
        self.peer_latency_s = 0.0
        self.call_host_s = 0.0
        self.op_seconds = None
        # what each thread has seen (the host's, the disk reader's): ``_ThreadView``
        self.lock = threading.RLock()
        self._tl = threading.local()
        self._views: list[_ThreadView] = []
        self.main = threading.current_thread()
        self.ops = 0
        self.host_syncs = 0               # host waits (stream, event, device synchronize)
        self.reader_syncs = 0             # the same waits made by the disk reader's thread
        self.read_waits = 0               # the host waited for a reader's job it joined (``SimReader``)
        self.disk_bytes_per_s: float | None = None
        self.disk_free = 0.0              # when the reader lane is free (virtual time)
        self.disk_reads: list[tuple[float, float, int]] = []   # (start, end, bytes) of each read
        self.read_ready: dict[int, float] = {}    # host buffer -> when its last disk read ended
        self.peak_resets = 0
        self.pinned_peak = 0              # most bytes from torch's page-locked allocator alive at once
        self.pageable_async: list[str] = []  # non-blocking copies from pageable host memory (they stall)
        self.peer_copies: list[tuple[int, int, int]] = []  # (source device, destination device, bytes)
        SimCuda.active = self
        self.computes = {d: SimStream(d, sim=self, eager=True) for d in range(devices)}
        self.compute = self.computes[0]
        self.allocs = {0: self.alloc}
        for d in range(1, devices):
            self.allocs[d] = SimAllocator(self._reused)
        self.view  # the host's

    # what the running thread has seen: its own virtual time, clock, stream stack, host context

    @property
    def view(self) -> "_ThreadView":
        v = getattr(self._tl, "view", None)
        if v is None:
            v = self._tl.view = _ThreadView(self.compute)
            self._views.append(v)
        return v

    host_t = property(lambda self: self.view.t, lambda self, t: setattr(self.view, "t", t))
    host_clock = property(lambda self: self.view.clock)
    stack = property(lambda self: self.view.stack)
    host_ctx = property(lambda self: self.view.ctx, lambda self, n: setattr(self.view, "ctx", n))

    def synced(self) -> None:
        """A host-blocking wait, counted by the thread that made it."""
        if threading.current_thread() is self.main:
            self.host_syncs += 1
        else:
            self.reader_syncs += 1

    def set_durations(self, copy_bytes_per_s: float | None = None, op_seconds=None,
                      copy_latency_s: float = 0.0, peer_bytes_per_s: float | None = None,
                      peer_latency_s: float = 0.0, call_host_s: float = 0.0,
                      disk_bytes_per_s: float | None = None) -> None:
        """Give copies from host memory, peer copies and operators durations (see the module
        docstring); ``copy_latency_s``, ``peer_latency_s``: the fixed cost of each such copy;
        ``call_host_s``: the host's own work of each executor call, before it issues anything;
        ``disk_bytes_per_s``: the disk reader's rate (reads one after another on one lane)."""
        self.timed = True
        self.copy_bytes_per_s, self.op_seconds = copy_bytes_per_s, op_seconds
        self.copy_latency_s = copy_latency_s
        self.peer_bytes_per_s, self.peer_latency_s = peer_bytes_per_s, peer_latency_s
        self.call_host_s = call_host_s
        self.disk_bytes_per_s = disk_bytes_per_s
        _forget_call_figure()   # the host's cost of a call is this configuration's

    def disk_read(self, dest: torch.Tensor, nbytes: int) -> None:
        """A read of ``nbytes`` from disk into host memory ``dest`` by the running thread: a CPU
        write (checked: no copy may still read those bytes); timed, it runs on the reader lane
        from when the thread issues it and the lane is free, and the thread waits for it."""
        with self.lock:
            self.access(self.compute, 0, dest, write=True, what="disk read")
            if not (self.timed and self.disk_bytes_per_s):
                return
            start = max(self.host_t, self.disk_free)
            self.disk_free = self.host_t = start + nbytes / self.disk_bytes_per_s
            self.disk_reads.append((start, self.disk_free, nbytes))
            self.read_ready[dest.untyped_storage().data_ptr()] = self.disk_free

    def copy_seconds(self, src: torch.Tensor) -> float:
        rec = self.recs.get(src.untyped_storage().data_ptr())
        if not self.copy_bytes_per_s or rec is None or not rec.host:
            return 0.0
        return self.copy_latency_s + src.numel() * src.element_size() / self.copy_bytes_per_s

    # devices

    def device_index(self, device, what: str) -> int:
        """The device a call means; one that names none means the current device (recorded)."""
        if device is None:
            self.device_calls.append((what, self.current_device))
            return self.current_device
        if isinstance(device, int):
            return device
        device = torch.device(device)
        if device.index is None:
            self.device_calls.append((what, self.current_device))
            return self.current_device
        return device.index

    def current_stream(self, device=None, what: str = "current_stream()") -> SimStream:
        d = self.device_index(device, what)
        top = self.stack[-1]
        return top if top.dev == d else self.computes[d]

    def alloc_of(self, device=None, what: str = "memory statistics") -> SimAllocator:
        return self.allocs[self.device_index(device, what)]

    def empty_cache(self) -> None:
        """Every device's cache, as torch's allocators do (both the native one and
        cudaMallocAsync, which synchronises each device first)."""
        self.empty_cache_calls += 1
        self.device_calls.append(("empty_cache()", self.current_device))
        for a in self.allocs.values():
            a.empty_cache()

    total_memory = 1 << 36   # what get_device_properties reports for every simulated device

    def set_memory_fraction(self, fraction: float, device=None) -> None:
        a = self.alloc_of(device, "set_per_process_memory_fraction()")
        a.cap = None if fraction >= 1.0 else int(fraction * self.total_memory)
        self.fraction_calls.append(fraction)

    def live_pinned_bytes(self) -> int:
        """Host bytes from torch's page-locked allocator (pin_memory) that are alive now."""
        return sum(r.nbytes for r in self.recs.values() if r.host and r.torch_pinned)

    @contextlib.contextmanager
    def host_memory(self):
        """Tensors made here are host memory (a model loaded on the CPU, its reference output)."""
        self.host_ctx += 1
        try:
            yield
        finally:
            self.host_ctx -= 1

    # streams and order

    def current(self) -> SimStream:
        return self.stack[-1]

    def wait(self, stream: SimStream, ev: SimEvent) -> None:
        if ev.stream is None or ev.stream is stream:
            return
        stream.t = max(stream.t, ev.t) if self.timed else stream.t
        for k, v in ev.clock.items():
            stream.clock[k] = max(stream.clock.get(k, 0), v)
        if stream.eager:
            self.flush(ev.stream, ev.pos)
        else:
            stream.queue.append(("wait", ev.stream, ev.pos))

    def flush(self, stream: SimStream, upto: int | None = None) -> None:
        with _disable_current_modes():
            while stream.queue:
                item = stream.queue[0]
                if item[0] == "op":
                    if upto is not None and item[1] > upto:
                        break
                    stream.queue.pop(0)
                    item[2]()
                    stream.done = item[1]
                else:
                    stream.queue.pop(0)
                    self.flush(item[1], item[2])
        if not stream.queue:
            stream.done = stream.pos

    @_locked
    def synchronize(self, device=None) -> None:
        self.synced()
        for s in list(self.streams):
            self.flush(s)
            self.host_t = max(self.host_t, s.t)
        for s in list(self.streams):
            self.host_observes(s.clock)

    def host_observes(self, clock: dict) -> None:
        changed = False
        mine = self.host_clock
        for k, v in clock.items():
            if v > mine.get(k, 0):
                mine[k] = v
                changed = True
        if changed:  # accesses every thread has seen finish can conflict with nothing issued later
            seen = {k: min(v.clock.get(k, 0) for v in self._views) for k in mine}
            for rec in self.recs.values():
                rec.acc = {key: p for key, p in rec.acc.items() if p > seen.get(key[0], 0)}

    def _ordered(self, stream: SimStream, sid: int, pos: int) -> bool:
        return stream.clock.get(sid, 0) >= pos or self.host_clock.get(sid, 0) >= pos

    # accesses

    def access(self, stream: SimStream, pos: int, t: torch.Tensor, write: bool, what: str) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
            return
        try:
            rec = self.recs.get(t.untyped_storage().data_ptr())
        except Exception:
            return
        if rec is None:
            return
        lo, hi = _extent(t)
        if lo == hi:
            return
        # Host memory touched by an operator on the compute stream is a CPU access: ordered by
        # what the host has waited for, and nothing a later stream must wait on.
        cpu = rec.host and stream.eager
        for (sid, w, a, b), p in rec.acc.items():
            if sid == stream.id or not (w or write) or not (a < hi and lo < b):
                continue
            if not (self.host_clock.get(sid, 0) >= p if cpu else self._ordered(stream, sid, p)):
                if write and not w:
                    kind = "write over bytes another stream may still read"
                elif write:
                    kind = "write racing another stream's write"
                else:
                    kind = "read of a buffer before its write is ordered"
                self.hazard(f"{kind}: {what} on {stream} reads/writes bytes {lo}:{hi} of "
                            f"{'host' if rec.host else 'device'} buffer {rec.base:#x}, last used by stream {sid} at {p}")
        if not cpu:
            rec.acc[(stream.id, write, lo, hi)] = pos

    def hazard(self, msg: str) -> None:
        self.hazards.append(msg)

    def _check_host_quiet(self, rec: _Rec, msg: str) -> None:
        for (sid, _w, _a, _b), p in rec.acc.items():
            if self.host_clock.get(sid, 0) < p and sid != self.compute.id:
                self.hazard(f"{msg} (stream {sid} at {p})")
                return

    # storages

    def track_new(self, t: torch.Tensor, stream: SimStream, host: bool | None = None) -> _Rec | None:
        st = t.untyped_storage()
        base, n = st.data_ptr(), st.nbytes()
        if base == 0 or base in self.recs:
            return self.recs.get(base)
        host = bool(self.host_ctx) if host is None else host
        block = None if host else self.allocs[stream.dev].alloc(n, stream.id)
        rec = _Rec(base, n, host, stream.id, block)
        rec.dev = stream.dev
        self.recs[base] = rec
        weakref.finalize(st, self._freed, rec)
        return rec

    @_locked
    def _freed(self, rec: _Rec) -> None:
        rec.alive = False
        self.recs.pop(rec.base, None)
        if rec.host:
            if rec.base in self.registered:
                self.hazard(f"registration left on a freed host buffer {rec.base:#x}")
                del self.registered[rec.base]
            if not rec.torch_pinned:
                self._check_host_quiet(rec, "host buffer freed while a copy may read it")
            return
        # The caching allocator hands a freed block out again at once on its own stream; uses
        # on other streams must be ordered before that reuse (or announced by record_stream).
        prev = [(sid, p) for (sid, _w, _a, _b), p in rec.acc.items()
                if sid != rec.stream_id and sid not in rec.recorded]
        if rec.block is not None:
            self.allocs[rec.dev].free(rec.block, prev)

    def _reused(self, stream_id: int, block) -> None:
        stream = next((s for s in self.streams if s.id == stream_id), None)
        for sid, p in block.prev:
            if stream is None or not self._ordered(stream, sid, p):
                self.hazard(f"device memory freed and reused on stream {stream_id} while stream {sid} "
                            f"may still use it (at {p})")
                return

    def is_device(self, t: torch.Tensor) -> bool:
        if _wrapper(t):  # where its inner tensors are
            return any(self.is_device(v) for v in vars(t).values() if isinstance(v, torch.Tensor))
        rec = self.recs.get(t.untyped_storage().data_ptr())
        return rec is not None and not rec.host

    def op_device(self, tensors: list, kwargs: dict) -> int | None:
        """The device an operator runs on: its device tensors', else the device it allocates on
        (the placement seam maps ``cuda:N`` to ``cpu:N``), else None (the current one)."""
        for t in tensors:
            rec = self.recs.get(t.untyped_storage().data_ptr())
            if rec is not None and not rec.host:
                return rec.dev
        dev = kwargs.get("device")
        if isinstance(dev, torch.device) and dev.index is not None:
            return dev.index
        return None

    def device_of(self, t: torch.Tensor) -> torch.device:
        """Where a tensor lives as the code under test sees it (``cuda:N`` for simulated device
        memory, a fake tensor's own device, else its real one)."""
        if isinstance(t, FakeTensor) or _wrapper(t):
            return t.device
        rec = self.recs.get(t.untyped_storage().data_ptr())
        return torch.device("cuda", rec.dev) if rec is not None and not rec.host else t.device

    def check_one_device(self, tensors: list, func) -> None:
        """An operator on device memory of two devices fails, as CUDA's do."""
        devs = sorted({r.dev for t in tensors if (r := self.recs.get(t.untyped_storage().data_ptr())) is not None
                       and not r.host and t.dim() > 0})
        if len(devs) > 1:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:{devs[0]} and cuda:{devs[1]}! (simulated, {func})")

    def peer_copy(self, func, src: torch.Tensor, kwargs: dict, dst_dev: int):
        """``src.to(cuda:N)`` from another device, as torch's CUDA copy does it: the copy runs on the
        source device's current stream after a barrier with the destination's current stream, and
        the destination's current stream waits for it (no host sync); the new tensor is the
        destination device's memory, allocated on its current stream."""
        src_rec = self.recs[src.untyped_storage().data_ptr()]
        s_stream, d_stream = self.current_stream(src_rec.dev), self.current_stream(dst_dev)
        self.peer_copies.append((src_rec.dev, dst_dev, src.untyped_storage().nbytes()))
        barrier = SimEvent()
        barrier.record(d_stream)
        s_stream.wait_event(barrier)
        with _disable_current_modes():
            out = torch.empty(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        _fill_fresh(out)
        rec = self.track_new(out, d_stream, host=False)
        pos = s_stream.issue()
        if self.timed and self.peer_bytes_per_s:
            s_stream.run_for(self.peer_latency_s + src.numel() * src.element_size() / self.peer_bytes_per_s)
        self.access(s_stream, pos, src, write=False, what=f"peer {func}")
        self.access(s_stream, pos, out, write=True, what=f"peer {func}")
        job = lambda d=_WeakView(out), s=_WeakView(src): _deferred_copy(d, s)  # noqa: E731
        if s_stream.eager:
            with _disable_current_modes():
                job()
        else:
            s_stream.queue.append(("op", pos, job))
        done = SimEvent()
        done.record(s_stream)
        d_stream.wait_event(done)
        return out

    def device_op(self, tensors: list) -> bool:
        if not tensors:
            return not self.host_ctx
        return any(self.recs.get(t.untyped_storage().data_ptr()) is not None
                   and not self.recs[t.untyped_storage().data_ptr()].host for t in tensors)

    def raise_pending(self) -> None:
        err, self.pending_error = self.pending_error, None
        raise PendingCudaError(f"CUDA error: out of memory (error {err} left pending by an earlier runtime call)")


class _SimMode(TorchDispatchMode):
    def __init__(self, sim: SimCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self.sim.lock:
            return self._dispatch(func, types, args, kwargs)

    def _dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        sim.ops += 1
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(t, FakeTensor) for t in flat):
            return func(*args, **kwargs)  # the engine's dry run: fake tensors have no memory to simulate
        wrapped = [type(t) for t in flat if isinstance(t, torch.Tensor) and _wrapper(t)]
        if wrapped:
            # A wrapper subclass has no storage of its own: run its own dispatch with this mode
            # on again, so that the operators it runs on its inner tensors (a clone of the
            # scales, a dequantize) are simulated, ordered and allocated like any other.
            with self:
                return wrapped[0].__torch_dispatch__(func, types, args, kwargs)
        tensors = [t for t in flat if isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided]
        if func.is_view or func in _METADATA_OPS:
            return func(*args, **kwargs)
        if sim.pending_error is not None and sim.device_op(tensors):
            sim.raise_pending()
        stream = sim.current()
        if sim.n_devices > 1 and func is aten._to_copy.default and tensors and not sim.host_ctx:
            dst = sim.op_device([], kwargs)
            src_rec = sim.recs.get(tensors[0].untyped_storage().data_ptr())
            if dst is not None and src_rec is not None and not src_rec.host and src_rec.dev != dst:
                return sim.peer_copy(func, args[0], kwargs, dst)
        if sim.n_devices > 1 and not sim.host_ctx:
            sim.check_one_device(tensors, func)
        if stream.eager and sim.n_devices > 1:
            # an operator runs on the compute stream of the device its tensors are on (a new
            # tensor for "cuda" with no index: the current device)
            dev = sim.op_device(tensors, kwargs)
            dev = sim.current_device if dev is None else dev
            if dev != stream.dev:
                stream = sim.computes[dev]
        if sim.host_ctx and stream.eager:   # CPU work on host tensors (a model loaded on the CPU)
            written = _written(func, args, kwargs)
            for t in tensors:
                rec = sim.recs.get(t.untyped_storage().data_ptr())
                if rec is not None and rec.host:
                    sim.access(stream, 0, t, write=any(t is w for w in written), what=f"host {func}")
            out = func(*args, **kwargs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided:
                    sim.track_new(t, stream)
            return out
        deferred = not stream.eager and func in (aten.copy_.default, aten._to_copy.default)
        if deferred:
            return self._deferred(func, args, kwargs, stream)
        pos = stream.issue()
        written = _written(func, args, kwargs)
        for t in tensors:
            sim.access(stream, pos, t, write=any(t is w for w in written), what=str(func))
        in_ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        if sim.timed and func in (aten.copy_.default, aten._to_copy.default):
            stream.run_for(sim.copy_seconds(args[1] if func is aten.copy_.default else args[0]))
        out = func(*args, **kwargs)
        if sim.timed and sim.op_seconds is not None:
            stream.run_for(sim.op_seconds(func, args, kwargs, out))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided:
                if t.untyped_storage().data_ptr() not in in_ptrs:
                    rec = sim.track_new(t, stream)
                    if rec is not None:
                        if not rec.host and func in (aten.empty.memory_format, aten.empty_strided.default):
                            _fill_fresh(t)
                        sim.access(stream, pos, t, write=True, what=str(func))
        return out

    def _deferred(self, func, args, kwargs, stream: SimStream):
        sim = self.sim
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            out = dst
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:
            src = args[0]
            blocking = not kwargs.get("non_blocking", False)
        host = sim.recs.get(src.untyped_storage().data_ptr())
        host = host if host is not None and host.host else None
        if host is not None and not blocking and not host.torch_pinned and host.base not in sim.registered:
            # CUDA stages a pageable source through its own buffer and returns only when it is
            # staged: the host stalls where the code asked it not to
            sim.pageable_async.append(f"{func} of {src.untyped_storage().nbytes()} B")
        if func is not aten.copy_.default:
            dtype = kwargs.get("dtype") or src.dtype
            out = torch.empty(src.shape, dtype=dtype)
            _fill_fresh(out)
            sim.track_new(out, stream, host=False)
            dst = out
        pos = stream.issue()
        if sim.timed:
            if host is not None:  # a copy from a piece a disk read fills starts once the read is done
                stream.t = max(stream.t, sim.read_ready.get(host.base, 0.0))
            stream.run_for(sim.copy_seconds(src))
        sim.access(stream, pos, src, write=False, what=f"deferred {func}")
        sim.access(stream, pos, dst, write=True, what=f"deferred {func}")
        keep = src if (r := sim.recs.get(src.untyped_storage().data_ptr())) is not None and r.torch_pinned else None
        # torch's host allocator keeps a page-locked source until the copy has run
        stream.queue.append(("op", pos, lambda d=_WeakView(dst), s=_WeakView(src), k=keep: _deferred_copy(d, s)))
        if host is not None and blocking:
            # a blocking copy from host memory returns when it is done: the host waits for it
            sim.synced()
            sim.flush(stream, pos)
            sim.host_observes(dict(stream.clock))
            sim.host_t = max(sim.host_t, stream.t)
        return out


class _WeakView:
    """A tensor's geometry and a weak reference to its storage: a queued copy must not keep
    memory alive that the program has freed (a GPU does not either)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.st = weakref.ref(t.untyped_storage())
        self.geom = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def get(self) -> torch.Tensor | None:
        st = self.st()
        if st is None:
            return None
        off, shape, stride, dtype = self.geom
        return torch.empty(0, dtype=dtype).set_(st, off, shape, stride)


def _deferred_copy(dst: _WeakView, src: _WeakView) -> None:
    d, s = dst.get(), src.get()
    if d is not None and s is not None:  # a freed end was reported as a hazard when it was freed
        d.copy_(s)


def _fill_fresh(t: torch.Tensor) -> None:
    st = t.untyped_storage()
    if st.nbytes():
        torch.empty(0, dtype=torch.uint8).set_(st).fill_(NAN_FILL)


def _storages_of(t: torch.Tensor) -> list:
    """``t`` itself, or a wrapper subclass's inner tensors (recursively)."""
    if not _wrapper(t):
        return [t]
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
    else:
        inner = [v for v in vars(t).values() if isinstance(v, torch.Tensor)]
    return [s for i in inner for s in _storages_of(i)]


def _wrapper(t: torch.Tensor) -> bool:
    """A wrapper tensor subclass (``_make_wrapper_subclass``): no storage of its own."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        t.untyped_storage().data_ptr()
        return False
    except RuntimeError:
        return True


_METADATA_OPS = {aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
                 aten._has_compatible_shallow_copy_type.default, aten.is_same_size.default,
                 aten.is_pinned.default}


def _written(func, args, kwargs) -> list:
    out = []
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


# -- installing it ----------------------------------------------------------------------------

class _SimProps:
    def __init__(self, total: int, index: int) -> None:
        self.total_memory, self.index, self.name = total, index, f"simulated cuda:{index}"


class _SimDevice:
    """``torch.cuda.device(i)``: the current device inside the block."""

    def __init__(self, device) -> None:
        self.idx = SimCuda.active.device_index(device, "device()") if device is not None else None

    def __enter__(self):
        sim = SimCuda.active
        self.prev = sim.current_device
        if self.idx is not None:
            sim.current_device = self.idx
        return self

    def __exit__(self, *exc):
        SimCuda.active.current_device = self.prev


def _placement(device: torch.device) -> torch.device:
    """Where a simulated device's tensors are made: host memory, ``cpu:N`` for ``cuda:N`` (N > 0),
    so the simulator knows which device an allocation is for."""
    return torch.device("cpu", device.index) if device.index is not None else torch.device("cpu")


def _forget_call_figure() -> None:
    """The executor's cost of a call measured on a simulated device (``bandwidth.executor_call``),
    dropped from memory and the cache file: it is the simulator's configuration (timed or wall
    clock, ``call_host_s``), which a new simulator or new durations change."""
    import json

    from vramcut_core.figures import bandwidth

    with bandwidth._lock:
        for k in [k for k in bandwidth._memo if k.startswith("call:")]:
            del bandwidth._memo[k]
        data = bandwidth._read_cache()
        if any(k.startswith("call:") for k in data):
            with open(bandwidth.cache_path(), "w", encoding="utf-8") as f:
                json.dump({k: v for k, v in data.items() if not k.startswith("call:")}, f)


def _host_work(sim: SimCuda, forward):
    """``SegmentedExecutor.forward`` after ``sim.call_host_s`` of the host's own work (the host
    time moves on by it: what the call issues cannot start before)."""
    def timed_forward(self, *a, **k):
        if sim.timed and sim.call_host_s:
            sim.host_t += sim.call_host_s
        return forward(self, *a, **k)
    return timed_forward


@contextlib.contextmanager
def simulated_cuda(monkeypatch, devices: int = 1, runtimes=()):
    """Patch ``torch.cuda`` and the executor's seams for the duration; yields the simulator.
    ``runtimes``: other copies of ``vramcut_core.runtime`` whose seams to patch too (the pack as
    ComfyUI imports it, a package named after its folder, has its own)."""
    from vramcut_core import runtime

    sim = SimCuda(devices)
    _forget_call_figure()   # a new simulated device

    def host_buffer_of(orig_host_buffer):
        def host_buffer(nbytes):
            sim.host_ctx += 1
            try:
                t = orig_host_buffer(nbytes)
                sim.track_new(t, sim.current(), host=True)
                return t
            finally:
                sim.host_ctx -= 1
        return host_buffer

    def record_stream(self, stream):
        sim.recorded_types.append(type(self).__name__)
        for t in _storages_of(self):   # a wrapper's dispatch passes it to its inner tensors
            rec = sim.recs.get(t.untyped_storage().data_ptr())
            if rec is not None:
                rec.recorded.add(stream.id)

    def is_pinned(self, *a, **k):
        def one(t):
            ptr = t.untyped_storage().data_ptr()
            return ptr in sim.registered or bool((r := sim.recs.get(ptr)) is not None and r.torch_pinned)
        return all(one(t) for t in _storages_of(self))   # a wrapper: its inner tensors (its dispatch)

    def pin_memory(self, *a, **k):
        if sim.pin_memory_fails:
            raise RuntimeError("CUDA error: out of memory (pinned host allocation)")
        sim.host_ctx += 1
        try:
            with _disable_current_modes():
                t = self.clone()
            rec = sim.track_new(t, sim.current(), host=True)
            rec.torch_pinned = True
            sim.pinned_peak = max(sim.pinned_peak, sim.live_pinned_bytes())
            return t
        finally:
            sim.host_ctx -= 1

    def read_into_of(orig_read_into):
        def read_into(dest, reads):
            sim.disk_read(dest, sum(r[3] for r in reads))
            return orig_read_into(dest, reads)
        return read_into

    reader = SimReader(sim)
    from vramcut_core.figures import bandwidth

    monkeypatch.setattr(bandwidth, "_placement", _placement)  # the probes' device tensors
    # The simulated device computes on this CPU, where a float16 matrix product runs about a
    # hundred times slower than a bfloat16 one (1024 x 1024: 8.5 s against 0.05 s on one core):
    # the matmul probe measures half precision in bfloat16, the same bytes, or one probe of a
    # float16 model takes many minutes.
    measure = bandwidth.measure_matmul
    monkeypatch.setattr(bandwidth, "measure_matmul", lambda device, dtype=torch.float32, *a, **k: measure(
        device, torch.bfloat16 if dtype == torch.float16 else dtype, *a, **k))
    cuda = torch.cuda
    for rt in (runtime, *runtimes):
        device_memory = importlib.import_module(rt.__name__ + ".device_memory")
        host_memory = importlib.import_module(rt.__name__ + ".host_memory")
        monkeypatch.setattr(device_memory, "_placement", _placement)
        monkeypatch.setattr(host_memory, "_host_buffer", host_buffer_of(host_memory._host_buffer))
        hops = importlib.import_module(rt.__name__ + ".hops")
        monkeypatch.setattr(hops, "_device_of", sim.device_of)
        disk = importlib.import_module(rt.__name__ + ".disk")
        monkeypatch.setattr(disk, "_READER", reader)
        monkeypatch.setattr(disk, "read_into", read_into_of(disk.read_into))
        executor = importlib.import_module(rt.__name__ + ".executor").SegmentedExecutor
        monkeypatch.setattr(executor, "forward", _host_work(sim, executor.forward))
    monkeypatch.setattr(cuda, "Stream", SimStream)
    monkeypatch.setattr(cuda, "Event", SimEvent)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: sim.current_stream(device))
    monkeypatch.setattr(cuda, "default_stream",
                        lambda device=None: sim.computes[sim.device_index(device, "default_stream()")])
    monkeypatch.setattr(cuda, "stream", lambda s: s if s is not None else contextlib.nullcontext())
    monkeypatch.setattr(cuda, "device", _SimDevice)
    monkeypatch.setattr(cuda, "current_device", lambda: sim.current_device)
    monkeypatch.setattr(cuda, "device_count", lambda: sim.n_devices)
    monkeypatch.setattr(cuda, "synchronize", sim.synchronize)
    monkeypatch.setattr(cuda, "cudart", lambda: _CudaRT(sim))
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: sim.alloc_of(device).allocated)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: sim.alloc_of(device).reserved)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: sim.alloc_of(device).max_allocated)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: sim.alloc_of(device).max_reserved)
    def reset_peak(device=None):
        sim.peak_resets += 1
        sim.alloc_of(device).reset_peak()

    monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset_peak)
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction", sim.set_memory_fraction)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device=None: (
        1.0 if (a := sim.alloc_of(device, "get_per_process_memory_fraction()")).cap is None
        else a.cap / sim.total_memory))
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda device=None: _SimProps(sim.total_memory, sim.device_index(device, "get_device_properties()")))
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (
        sim.total_memory - sim.alloc_of(device, "mem_get_info()").reserved, sim.total_memory))
    monkeypatch.setattr(cuda, "empty_cache", sim.empty_cache)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    mode = _SimMode(sim)
    with mode:
        try:
            yield sim
        finally:
            reader.shutdown()
            sim.synchronize()
    SimCuda.active = None
