"""The segmented executor: runs a module's forward under a plan.

Mechanics (the same on CPU and CUDA, so CPU tests exercise all of it):

* Host masters. A unit's tensors stay where the model keeps them. On CUDA, a streamed unit's
  plain tensors are moved once into one exact-size flat host buffer per unit, page-locked with
  ``cudaHostRegister`` where possible; the parameters then live there, so that buffer *is* the
  master: no second host copy, and nothing is ever copied back on eviction. On CPU, or where
  pinning fails, the tensors are their own masters and are copied one by one.
* Device memory it owns. Resident units get one flat device buffer each; streamed segments
  (adjacent streamed units the plan merged) cycle through (at most) two slot buffers of the
  plan's slot size, a segment's units back to back in one slot. Every byte placed on the device is
  counted (``device_bytes``, ``peak_weight_bytes``).
* Pointer swaps. While a unit's weights are on the device, its parameters' ``.data`` point at
  views of the executor's buffers; quantized tensor subclasses are taken apart into their inner
  tensors (``quant``), which sit in the same flat buffers, and the layer sees a new object of
  the same type around the device views, its metadata intact (a subclass that cannot be taken
  apart is moved as an object beside the slots, and counted); afterwards they point back at
  their masters. After a forward the model holds the same Parameter objects as before.
* Scheduling by unit. Forward pre-hooks tell the executor which unit runs; nothing counts
  calls, so skipped blocks, replaced blocks and blocks run twice are all fine. A measuring
  forward hooks every module that reads a unit's tensors; other forwards hook only streamed
  units, at their roots where every measuring forward saw the unit's modules run inside a root's
  call (else at every module, as a UNet's timestep-embed sequential needs). Entering a streamed
  unit waits for its segment's copy (or loads the segment then), and starts copying the next
  streamed segment into the other slot.
* One transfer per segment. A segment's units are copied one after another (on CUDA from each
  unit's own host master) between one wait and one event, which all its units share.
* Prefetch (CUDA). Copies run on a side stream. Compute waits only on the event of the copy it
  needs, and a copy into a slot first waits on an event recorded on the compute stream, so it
  never overwrites weights that queued kernels still read.
* Exact restore. Hooks are removed and every tensor is pointed back at its master in
  ``finally``: after a forward, an exception or an interrupt the module is as it was. One
  exception, for bookkeeping near zero: inside a session (or a host's sampling run, with
  ``hold_weights``) a plan that keeps every unit resident keeps its weights swapped in between
  forwards, so a forward runs no hook and swaps no pointer; they go back on release (the
  session's end), an error, an interrupt, ``invalidate``, a new plan, and before any forward of
  the module that is not ours.
* Host masters are owned for the process: shared by executors on the same tensors, kept across
  sessions, page-locked up to a cap (``PIN_FRACTION`` of RAM, portable to every GPU), unpinned by
  a finalizer once the copies reading them have finished. A failed registration's pending CUDA
  error is cleared where it happens. A pageable master is copied through a page-locked staging
  buffer, so the copy stays asynchronous.
* Other readers. Streams the host reads weights on (offload-stream casts) are handed in as
  ``reader_streams`` and wait on the same copy events as the compute stream.
* Every CUDA synchronisation point carries a comment naming the hazard it prevents; the tests
  run this branch on a simulated accelerator (tests/sim_cuda.py) that fails on each hazard.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import weakref
from typing import Callable

import torch
from torch import nn

from .measure import CPUMeter, CUDAMeter, Meter, OverBudget, UnitMeasurement
from .plan import Plan
from .report import RunStats
from . import quant
from .tensors import align_up, is_plain_tensor, tensor_nbytes
from .units import Unit


@dataclasses.dataclass
class _Layout:
    """Where a unit's plain tensors sit in a flat buffer, and its subclass tensors."""

    flat: list[tuple[int, int, int]]   # (index into unit.tensors, byte offset, nbytes)
    other: list[int]                   # indices of tensors moved one by one (subclasses)
    nbytes: int                        # flat buffer size (aligned)
    other_bytes: int
    # quantized subclasses taken apart (vramcut_core.quant): index -> [(offset, nbytes)] per part
    quant: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)


def _layout(unit: Unit) -> _Layout:
    flat, other, off, other_bytes = [], [], 0, 0
    qparts: dict[int, list[tuple[int, int]]] = {}
    for i, ut in enumerate(unit.tensors):
        if is_plain_tensor(ut.tensor) and ut.tensor.is_contiguous():
            n = ut.tensor.numel() * ut.tensor.element_size()
            flat.append((i, off, n))
            off = align_up(off + n)
        elif (ps := quant.parts(ut.tensor)) is not None:
            qparts[i] = []
            for p in ps:
                n = p.numel() * p.element_size()
                qparts[i].append((off, n))
                off = align_up(off + n)
        else:
            other.append(i)
            other_bytes += tensor_nbytes(ut.tensor)
    return _Layout(flat, other, off, other_bytes, qparts)


def _quant_views(buf: torch.Tensor, t: torch.Tensor, spans: list[tuple[int, int]], base: int = 0) -> list[torch.Tensor]:
    """Views of ``buf`` (from byte ``base``) shaped like the parts of quantized tensor ``t``."""
    return [_view(buf, base + off, n, p) for (off, n), p in zip(spans, quant.parts(t))]


def _view(buf: torch.Tensor, off: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``buf`` shaped like ``like``. Made once per buffer, place and shape: slots and
    resident buffers are copied into and swapped in on every forward, and a typed view of a byte
    buffer costs microseconds. The views live with the buffer (freed with it); tensors pointed
    at one share its memory, never its metadata."""
    cache = getattr(buf, "_vramcut_views", None)
    if cache is None:
        cache = buf._vramcut_views = {}
    key = (off, n, like.dtype, like.shape, torch.is_inference_mode_enabled())  # (a view made in
    # inference mode is an inference tensor: it must not be reused for a copy outside it)
    v = cache.get(key)
    if v is None:
        v = cache[key] = buf[off:off + n].view(like.dtype).view(like.shape)
    return v


# -- host memory ------------------------------------------------------------------------------

_HOST_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every GPU, not only the current one
PIN_FRACTION = 0.45           # at most this share of physical RAM is page-locked by the pack
                              # (Windows refuses past about half of RAM; the host pins too)


def _placement(device: torch.device) -> torch.device:
    """Where tensors for ``device`` are created: the device itself (a simulated accelerator in the
    tests maps it to host memory)."""
    return device


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _physical_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        try:
            import psutil
            return int(psutil.virtual_memory().total)
        except Exception:
            return None


class _PinLedger:
    """Bytes the pack has page-locked in this process, against a cap; ``room`` (set by a host
    that pins memory itself) says how many more bytes its own limit leaves for the pack."""

    def __init__(self) -> None:
        self.bytes = 0
        self.cap: int | None = None
        self.room: Callable[[], int] | None = None
        # Staging buffers from torch's page-locked host allocator: it keeps them cached, so the
        # most staged at once (rounded as it rounds) stays page-locked, counted in ``bytes``.
        self.staging = 0
        self._in_flight: list[tuple[object, int]] = []   # (event of the copy reading it, bytes)

    def staging_room(self, n: int) -> bool:
        """Whether staging ``n`` more bytes now stays within the cap and the host's room."""
        self._in_flight = [(ev, b) for ev, b in self._in_flight if not ev.query()]
        grow = sum(b for _, b in self._in_flight) + _host_alloc_size(n) - self.staging
        return grow <= 0 or self.allows(grow)

    def staged(self, done, n: int) -> None:
        """``n`` bytes were staged for the copy that ``done`` marks."""
        if not n:
            return
        self._in_flight.append((done, n))
        now = sum(b for _, b in self._in_flight)
        if now > self.staging:
            self.bytes += now - self.staging
            self.staging = now

    def limit(self) -> int | None:
        if self.cap is None:
            ram = _physical_ram()
            self.cap = int(ram * PIN_FRACTION) if ram else -1
        return None if self.cap < 0 else self.cap

    def allows(self, n: int) -> bool:
        cap = self.limit()
        if cap is not None and self.bytes + n > cap:
            return False
        return self.room is None or n <= self.room()


PINNED = _PinLedger()


def _clear_cuda_error(place: torch.device) -> None:
    """A failed runtime call (cudaHostRegister) stays the thread's last CUDA error, and the next
    unrelated kernel launch would raise it ("CUDA error: out of memory", not an OutOfMemoryError).
    A tiny kernel launch reads and clears it here, where it is expected."""
    try:
        torch.empty(1, dtype=torch.uint8, device=place).zero_()
    except RuntimeError:
        pass


def _unpin(buf: torch.Tensor, readers: dict, place: torch.device) -> None:
    """Unregister a master (finalizer and release share it): first wait for every copy that may
    still read it."""
    for ev in list(readers.values()):
        ev.synchronize()  # hazard: unregistering host memory an in-flight copy still reads
    readers.clear()
    try:
        err = torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        if int(getattr(err, "value", err)) != 0:
            _clear_cuda_error(place)
    except Exception:
        _clear_cuda_error(place)
    PINNED.bytes -= buf.numel()


def _host_alloc_size(n: int) -> int:
    """What torch's page-locked host allocator reserves for ``n`` bytes (a power of two)."""
    return 1 << max(0, n - 1).bit_length() if n else 0


def _staged(buf: torch.Tensor, place: torch.device) -> tuple[torch.Tensor, bool]:
    """A page-locked copy of a pageable master from torch's host allocator (reused after the copy
    that reads it has finished), so the device copy stays asynchronous; the master itself where
    that fails or the page-locked room is spent (copied synchronously, on purpose)."""
    if not PINNED.staging_room(buf.numel()):
        return buf, False
    try:
        return buf.pin_memory(), True
    except RuntimeError:
        _clear_cuda_error(place)
        return buf, False


_SHARED_MASTERS: "weakref.WeakValueDictionary[tuple, _HostMaster]" = weakref.WeakValueDictionary()
_EXECUTORS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()


class _HostMaster:
    """One unit's plain tensors in a single flat host buffer, page-locked when possible.

    Owned for the process: shared by every executor on the same tensors, kept across sessions,
    unregistered when the last owner drops it (after the copies reading it have finished)."""

    def __init__(self, unit: Unit, layout: _Layout, place: torch.device | None = None) -> None:
        # outside inference mode: the parameters will live in this buffer for good, and must not
        # turn into inference tensors (training nodes leave inference mode)
        with torch.inference_mode(False):
            self.buf = _host_buffer(layout.nbytes)
            for i, off, n in layout.flat:
                t = unit.tensors[i].tensor
                _view(self.buf, off, n, t).copy_(t.data)
            for i, off, n in layout.flat:  # the flat buffer is now the master: drop the old storage
                t = unit.tensors[i].tensor
                t.data = _view(self.buf, off, n, t)
            for i, spans in layout.quant.items():
                t = unit.tensors[i].tensor
                for v, p in zip(_quant_views(self.buf, t, spans), quant.parts(t)):
                    v.copy_(p)
            for i, spans in layout.quant.items():  # likewise for quantized tensors' parts
                t = unit.tensors[i].tensor
                quant.rehome_(t, _quant_views(self.buf, t, spans))
        self.pinned = False
        self.readers: dict[int, object] = {}   # copy stream id -> event of its last copy from here
        self._fin = None
        place = place if place is not None else torch.device("cuda")
        if self.buf.numel() and PINNED.allows(self.buf.numel()):
            try:
                err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(),
                                                           _HOST_REGISTER_PORTABLE)
                self.pinned = int(getattr(err, "value", err)) == 0
            except Exception:
                self.pinned = False
            if self.pinned:
                PINNED.bytes += self.buf.numel()
                self._fin = weakref.finalize(self, _unpin, self.buf, self.readers, place)
            else:
                _clear_cuda_error(place)

    def backs(self, unit: Unit, layout: _Layout) -> bool:
        """Do the unit's tensors still live in this buffer?"""
        base = self.buf.data_ptr()
        return (all(unit.tensors[i].tensor.data_ptr() == base + off for i, off, _ in layout.flat)
                and all(p.data_ptr() == base + off for i, spans in layout.quant.items()
                        for (off, _), p in zip(spans, quant.parts(unit.tensors[i].tensor))))

    def read_by(self, stream, done) -> None:
        self.readers[id(stream)] = done

    def release(self) -> None:
        """Unpin (after the copies reading it); the tensors keep living in the pageable buffer."""
        if self._fin is not None:
            self._fin()
        self.pinned = False


def _masters_holding(unit: Unit) -> list:
    """Masters of ours whose buffers hold ``unit``'s tensors although they are not its own (a
    part of a unit cut finer still lives in the whole unit's master): a copy from them must be
    waited for before they are unpinned."""
    spans = {(m.buf.data_ptr(), m.buf.data_ptr() + m.buf.numel()): m for m in list(_SHARED_MASTERS.values())
             if m.pinned}
    out = []
    for ut in unit.tensors:
        try:
            ptr = ut.tensor.data_ptr()
        except RuntimeError:
            continue
        for (lo, hi), m in spans.items():
            if lo <= ptr < hi and m not in out:
                out.append(m)
    return out


class _DeviceCopy:
    """A unit's weights on the device: views into a flat buffer plus subclass tensors. Units
    copied together (a streamed segment) share one ``ready`` event."""

    def __init__(self) -> None:
        self.unit: str | None = None
        self.views: dict[int, torch.Tensor] = {}     # tensor index -> device tensor
        self.parts: dict[int, list[torch.Tensor]] = {}  # quantized tensor index -> device parts
        self.ready: object | None = None             # CUDA event of the copy, or None
        self.patched = False                         # on_loaded has run on this copy


@dataclasses.dataclass
class _Slot:
    """A streaming slot: one buffer holding the copies of one streamed segment's units, back to
    back, in execution order."""

    buf: torch.Tensor
    copies: dict[str, _DeviceCopy] = dataclasses.field(default_factory=dict)

    @property
    def group(self) -> tuple[str, ...] | None:
        return tuple(self.copies) or None


class SegmentedExecutor:
    """Runs forwards of ``module`` under plans; owns the device buffers of one module.

    ``units`` maps a unit name to its ``Unit`` (split units included). Use as::

        with executor.session():
            out, stats, meas = executor.forward(plan, fn, *args, **kwargs)
    """

    def __init__(self, units: Callable[[str], Unit], device: torch.device | str,
                 pin_memory: bool | None = None, track_cpu_memory: bool = False,
                 module: nn.Module | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._place = _placement(self.device)
        self._unit = units
        self._pin = self.cuda if pin_memory is None else (pin_memory and self.cuda)
        self.track_cpu_memory = track_cpu_memory  # meter every CPU forward (slow), not only measured ones
        self._layouts: dict[str, _Layout] = {}
        self._masters: dict[str, _HostMaster] = {}
        self._resident: dict[str, tuple[torch.Tensor, _DeviceCopy]] = {}
        self._slots: list[_Slot] = []
        self.device_bytes = 0
        self.peak_weight_bytes = 0
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._in_session = 0
        self.keep_buffers = False   # hold device buffers between forwards until release()
        self._running = False
        # per-forward state
        self._plan: Plan | None = None
        self._next: dict[str, tuple[str, ...] | None] = {}   # unit -> the streamed group to prefetch
        self._group_of: dict[str, tuple[str, ...]] = {}       # streamed unit -> its segment's units
        self._resident_names: set[str] = set()
        self._current: str | None = None
        self._last_streamed: tuple[str, ...] | None = None   # the streamed group running
        self._stats: RunStats | None = None
        self._meter: Meter | None = None
        self._meas: dict[str, UnitMeasurement] | None = None
        self._order: list[str] = []
        self._entered_modules: set[int] = set()
        self._hooks: list = []
        self._hooked: tuple[str, ...] | None = None
        self._limit: int | None = None      # measuring forward: stop before passing this many bytes
        self._act_seen = self._cuda_peak = 0
        self.failed_unit: str | None = None  # the unit that ran when the last forward raised
        self.failed_device_bytes = 0         # and the bytes the executor held then
        self.failed_plan: Plan | None = None
        self._swapped: dict[str, dict[int, torch.Tensor]] = {}  # unit -> index -> host tensor
        self._events: list[tuple[object, object]] = []          # CUDA (start, end) copy events
        self._waits: list[tuple[object, object]] = []
        # Called with a unit once a fresh copy of its weights is on the device and its tensors
        # point at it, before any of its modules runs (on CUDA: on the compute stream, after the
        # copy's event): the host merges weight patches (LoRA) into the device copy there, so
        # the host keeps one unpatched copy of every weight.
        self.on_loaded: Callable[[Unit], None] | None = None
        # Entered around every device allocation the executor makes during a forward (its
        # buffers, and on_loaded's): a host that records the forward's allocations into a graph
        # (newer ComfyUI's malloc graphs) pauses the recording there, since ours do not repeat.
        self.alloc_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._timing: list[tuple[object, object]] = []          # CUDA (start, end) of forwards not yet timed
        self._base = self._base_reserved = 0                    # device bytes not ours at forward start
        self._reset_peak = True
        self._last_plan: Plan | None = None
        self._stale_copies = False
        self._staged_bytes = 0   # page-locked staging bytes of the transfer being issued
        # Other streams that read the weights while they are swapped in (the host's offload
        # streams): each waits on the same copy events as the compute stream.
        self.reader_streams: Callable[[], list] | None = None
        if module is not None:  # executors on one module hold device buffers one at a time
            _EXECUTORS.setdefault(module, weakref.WeakSet()).add(self)
        self._module = weakref.ref(module) if module is not None else None
        # Collected without release (an interrupted run, an engine replaced): hooks go, host
        # masters are unpinned once the copies reading them have finished.
        weakref.finalize(self, _finalize_executor, self._copy_stream, self._hooks, self._masters)
        # Hook dispatch and held weights (see _hook_units and _hold): an all-resident plan keeps
        # its weights swapped in between forwards of a session (or, with ``hold_weights``, while
        # buffers are kept); the module is whole again on release, error, interrupt, invalidate,
        # a plan change, or a forward of the module that is not ours.
        self.hold_weights = False
        self._held: Plan | None = None
        self._held_undo: list = []    # (unit tensor, host master, plain): a finalizer's restore list
        self._guard: list = []        # the module's pre-hook while weights are held
        self._contained: dict[str, bool] = {}  # unit -> every module call seen ran inside a root's call
        self._roots_active: dict[str, int] = {}
        self._uncontained: set[str] = set()
        self.failed_tracked = True    # the failed forward tracked every unit (not only streamed ones)
        weakref.finalize(self, _undo_held, self._held_undo, self._guard)

    # -- public API -------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self):
        """Keeps device buffers (resident weights, prefetched slots) between forwards; releases
        them when the session ends, however it ends."""
        self._in_session += 1
        try:
            yield self
        finally:
            self._in_session -= 1
            if not self._holding and not self._running:
                self.release()
            elif not self._in_session and not self.hold_weights and not self._running:
                self._drop_held()  # buffers kept past the session; the weights are not

    def forward(self, plan: Plan, fn: Callable, *args, measure: bool = False,
                limit_bytes: int | None = None, **kwargs):
        """Run ``fn(*args, **kwargs)`` (a forward of the module) under ``plan``.

        Returns ``(output, stats, measurements)``; measurements (per unit, activation bytes) only
        when ``measure`` is true, else None. With ``limit_bytes`` (measuring forwards) the forward
        is stopped with ``OverBudget`` as soon as weights on the device plus live activations
        pass it (on CPU at the allocation that would pass it; on CUDA at the next module call),
        or when it enters a unit larger than the plan's slot.
        """
        if self._running:
            raise RuntimeError("SegmentedExecutor.forward is not re-entrant")
        self._running = True
        stats = RunStats(forwards=1)
        self._stats = stats
        ok = False
        t0 = time.perf_counter()
        start_ev = end_ev = None
        self._limit = limit_bytes if measure else None
        self._act_seen = self._input_bytes = self._cuda_peak = 0
        self.failed_unit = None
        self.peak_weight_bytes = self.device_bytes  # this forward's peak, not the executor's lifetime's
        global_hooks = []
        capped = None   # the allocator's fraction to restore after a capped measuring forward
        try:
            self._release_others()
            if self.cuda:
                # Peaks are process-wide statistics: reset only when this forward measures, or
                # switches plans (the switch is where the old and new buffers could overlap).
                self._reset_peak = measure or plan is not self._last_plan
                if self._reset_peak:
                    torch.cuda.reset_peak_memory_stats(self.device)
                    self._base_reserved = torch.cuda.memory_reserved(self.device) - self.device_bytes
                start_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record(torch.cuda.current_stream(self.device))
            self._last_plan = plan
            resumed = self._resume_held(plan, measure)
            if not resumed:
                self._begin(plan)
            if self.cuda:
                self._base = torch.cuda.memory_allocated(self.device) - self.device_bytes
            self._meter = self._make_meter(measure)
            self._meas = {} if self._meter is not None else None
            self._order = []
            self._entered_modules = set()
            # inputs count as activations; walked only when measuring (not on every forward)
            self._input_bytes = _input_bytes(args, kwargs, self.device) if self._meter is not None else 0
            if self._meter is not None:
                self._meter.start()
            if self.cuda and self._limit is not None:
                capped = self._cap_allocator(self._limit)
            if not resumed:
                self._hook_units(plan, self._meas is not None)
            if self.cuda and self._limit is not None:
                # the allocator cannot call back: check between module calls while measuring
                check = lambda *_a: self._check_live()  # noqa: E731
                global_hooks = [nn.modules.module.register_module_forward_pre_hook(check),
                                nn.modules.module.register_module_forward_hook(check)]
            out = fn(*args, **kwargs)
            ok = True
            return out, stats, self._finish_measure()
        except torch.OutOfMemoryError:
            if capped is None:
                raise
            # the cap stopped an allocation (an intra-module temporary) that would pass the budget
            act = max(self._act_seen, self._limit - self.peak_weight_bytes + 1)
            raise OverBudget("activations", self._current, self.peak_weight_bytes, act, self._limit) from None
        finally:
            if capped is not None:
                torch.cuda.set_per_process_memory_fraction(capped, self.device)
            for h in global_hooks:
                h.remove()
            if not ok:
                self.failed_unit, self.failed_device_bytes, self.failed_plan = self._current, self.device_bytes, plan
                self.failed_tracked = self._meas is not None
            if not ok or not self._holding:
                self._remove_hooks()
            if self._meter is not None:
                self._meter.stop()
            self._after_forward(plan, ok)
            self._current = self._last_streamed = None
            try:
                if ok and plan.slots == 2 and self._holding:
                    self._prefetch_first(plan)  # wrap around: ready for the next forward
                if self.cuda:
                    end_ev = torch.cuda.Event(enable_timing=True)
                    end_ev.record(torch.cuda.current_stream(self.device))
                    self._collect_cuda_stats(stats, start_ev, end_ev)
                else:
                    # CPU copies are synchronous: compute waits for every one of them
                    wall = time.perf_counter() - t0
                    stats.time_wait_s = stats.time_copy_s
                    stats.time_compute_s = max(0.0, wall - stats.time_copy_s)
                stats.peak_weight_bytes = self.peak_weight_bytes
                if not self.cuda and self._meas is not None:
                    stats.peak_device_bytes = self.peak_weight_bytes + max(
                        (m.peak_bytes for m in self._meas.values()), default=0)
            finally:
                self._meter = None
                self._limit = None
                self._running = False
                self._plan = None
                if not ok or not self._holding:
                    self.release()  # after an error (out of memory included) nothing stays on the device

    @property
    def _holding(self) -> bool:
        return bool(self._in_session) or self.keep_buffers

    @property
    def running(self) -> bool:
        return self._running

    def release(self) -> None:
        """Free every device buffer the executor holds; unpin host masters."""
        if self._running:
            raise RuntimeError("cannot release while a forward runs")
        if self.cuda:
            self._copy_stream.synchronize()  # hazard: freeing slots a prefetch is still writing
            # hazard: freeing buffers that queued kernels on the compute stream still read
            torch.cuda.current_stream(self.device).synchronize()
        self._remove_hooks()
        self._drop_held()
        self._restore_all()
        self._resident.clear()
        self._slots.clear()
        # host masters stay (pinned, owned for the process): the next session streams at once
        self._events.clear()
        self._timing.clear()
        self.device_bytes = 0
        self._last_plan = None
        self._stale_copies = False
        if self.cuda:
            self._empty_cache()  # hazard: freed buffers stay reserved, lost to other programs

    def invalidate(self) -> None:
        """The host writes (or wrote) into the weights in place (hook LoRAs): device copies held
        between forwards are stale; the next forward copies them again. Called before the write,
        it also makes the write safe."""
        if self.cuda:
            self._copy_stream.synchronize()  # hazard: the host writing masters a prefetch still reads
        if not self._running:
            self._drop_held()  # the host writes into (and reads) its masters, not our device copies
        self._stale_copies = True

    def _release_others(self) -> None:
        """Another executor on the same module (two nodes on one model) gives its buffers back
        before this one allocates: the device never holds both budgets."""
        mod = self._module() if self._module is not None else None
        if mod is None:
            return
        for other in list(_EXECUTORS.get(mod, ())):
            if other is not self and not other.running and other.device_bytes:
                other.release()

    def forget_units(self) -> None:
        """Drop layouts and masters (the module's tensors were replaced from outside)."""
        self.release()
        for m in self._masters.values():
            m.release()
        self._masters.clear()
        self._layouts.clear()

    # -- buffers ---------------------------------------------------------------------------

    def _cap_allocator(self, limit: int) -> float:
        """A measuring forward on CUDA: cap this process's memory on the device at what others
        hold now plus the budget, so that an allocation that would pass the budget (a temporary
        made and freed inside one module, which no hook sees) fails where it is made, and the
        engine cuts finer. Returns the fraction to restore."""
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        prev = get(self.device) if get is not None else 1.0
        # hazard: cached blocks would serve a temporary past the budget without touching the cap
        self._empty_cache()
        others = torch.cuda.memory_allocated(self.device) - self.device_bytes - self._input_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (others + limit) / total), self.device)
        return prev

    def _empty_cache(self) -> None:
        with torch.cuda.device(self.device):  # the executor's device, not the current one
            torch.cuda.empty_cache()

    def _alloc(self, nbytes: int) -> torch.Tensor:
        ctx = self._meter.paused() if isinstance(self._meter, CPUMeter) else contextlib.nullcontext()
        with ctx, self.alloc_context():
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self._place)
        self._account(nbytes)
        return buf

    def _account(self, delta: int) -> None:
        self.device_bytes += delta
        self.peak_weight_bytes = max(self.peak_weight_bytes, self.device_bytes)
        if delta > 0 and self._limit is not None:
            self._check_live()

    def _check_live(self, live: int | None = None) -> None:
        """Measuring forward: stop before weights plus activations pass the limit."""
        if self._limit is None or not self._running:
            return
        if live is None:
            m = self._meter
            live = 0 if m is None else (max(m.live(), m.peak()) if self.cuda else m.live())
        self._act_seen = max(self._act_seen, live + self._input_bytes)
        if self.peak_weight_bytes + self._act_seen > self._limit:
            raise OverBudget("activations", self._current, self.peak_weight_bytes, self._act_seen, self._limit)

    def layout(self, name: str) -> _Layout:
        lay = self._layouts.get(name)
        if lay is None:
            lay = self._layouts[name] = _layout(self._unit(name))
        return lay

    def unit_device_bytes(self, name: str) -> int:
        lay = self.layout(name)
        return lay.nbytes + lay.other_bytes

    def _begin(self, plan: Plan) -> None:
        self._plan = plan
        resident = set(plan.resident_units)
        groups = plan.streamed_groups
        # free what the new plan no longer keeps, before allocating anything new (helpers, so
        # that no local variable keeps a freed buffer alive)
        freed = self._free_unkept(resident, plan)
        if self._stale_copies:
            self._drop_slot_copies(lambda _g: True)
        else:  # a unit the new plan keeps resident must not also sit in a slot; groups it cuts
            kept = set(groups)  # differently are copied again
            self._drop_slot_copies(lambda g: g not in kept or any(n in resident for n in g))
        grows = len(self._slots) < plan.slots or any(n not in self._resident for n in plan.resident_units)
        if (freed or grows) and self.cuda:
            # hazard: blocks freed (or cached by the last forward's activations) stay reserved
            # next to the new buffers; only when buffers change (a new plan), never in a steady step
            self._empty_cache()
        self._resident_names = resident
        want_slots = plan.slots
        for name in plan.resident_units:
            if name not in self._resident:
                buf = self._alloc(self.layout(name).nbytes)
                self._resident[name] = (buf, self._load((name,), buf, sync=True)[name])
                del buf
            elif self._stale_copies:  # the host wrote into the masters: copy them again
                self._reload_resident(name)
        self._stale_copies = False
        while len(self._slots) < want_slots:
            self._slots.append(_Slot(self._alloc(plan.slot_bytes)))
        self._group_of = {n: g for g in groups for n in g}
        pos = {g: i for i, g in enumerate(groups)}
        nxt: dict[str, tuple[str, ...] | None] = {}
        # the next streamed group after each unit, in execution order (wrapping to the first)
        upcoming = groups[0] if groups else None
        for u in reversed(plan.units):
            nxt[u.name] = upcoming
            if u.name in self._group_of:
                upcoming = self._group_of[u.name]
        # A forward that loops over streamed units (a video VAE, frame by frame) does not start
        # its next pass at the first group: wrapping there would copy it for nothing (the pass
        # loads what it enters; the next forward's first group is prefetched after this one).
        loops = any(u.calls > 1 for u in plan.units if u.name in self._group_of)
        for g in groups:
            last = pos[g] + 1 == len(groups)
            after = None if len(groups) < 2 or (loops and last) else groups[(pos[g] + 1) % len(groups)]
            for n in g:
                nxt[n] = after
        self._next = nxt
        for name, (_, dc) in self._resident.items():
            self._swap_in(name, dc)
            self._loaded(name, dc)
        for s in self._slots:
            for n, dc in s.copies.items():
                self._swap_in(n, dc)
        if (groups and plan.slots and self._slot_of(groups[0][0]) is None
                and self._group_bytes(groups[0]) <= plan.slot_bytes):  # a measuring slot may not hold it
            self._load_into_slot(groups[0], self._slots[0], sync=not self.cuda)

    def _group_bytes(self, group: tuple[str, ...]) -> int:
        """Flat bytes of units copied back to back (each layout is aligned)."""
        return sum(self.layout(n).nbytes for n in group)

    def _free_unkept(self, resident: set, plan: Plan) -> bool:
        freed = False
        for name in [n for n in self._resident if n not in resident]:
            buf, dc = self._resident.pop(name)
            self._account(-buf.numel() - self._other_bytes(dc))
            freed = True
        if len(self._slots) > plan.slots or any(s.buf.numel() != plan.slot_bytes for s in self._slots):
            if self.cuda:
                # hazard: freeing a slot a prefetch still writes (the allocator hands it out again
                # on the compute stream, which now runs after the copy: no host wait)
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            for s in self._slots:
                self._account(-s.buf.numel() - self._slot_other_bytes(s))
            self._slots = []
            freed = True
        return freed

    def _drop_slot_copies(self, drop: Callable[[tuple[str, ...]], bool]) -> None:
        for s in self._slots:
            if s.copies and drop(s.group):
                self._account(-self._slot_other_bytes(s))
                s.copies = {}

    def _slot_other_bytes(self, slot: _Slot) -> int:
        return sum(self._other_bytes(dc) for dc in slot.copies.values())

    def _reload_resident(self, name: str) -> None:
        buf, dc = self._resident[name]
        self._account(-self._other_bytes(dc))
        self._resident[name] = (buf, self._load((name,), buf, sync=True)[name])

    def _other_bytes(self, dc: _DeviceCopy) -> int:
        if dc.unit is None:
            return 0
        lay = self.layout(dc.unit)
        return lay.other_bytes

    def _master(self, name: str) -> _HostMaster | None:
        """The flat host master of a streamed unit (CUDA only). None means: copy tensor by tensor
        from where they are (CPU; tensors the host has already page-locked itself)."""
        if not self._pin:
            return None
        unit, lay = self._unit(name), self.layout(name)
        m = self._masters.get(name)
        if m is not None and not m.backs(unit, lay):
            m.release()  # someone moved the tensors since (the host): rebuild
            m = None
        if m is None:
            if not lay.nbytes:
                return None
            key = tuple(id(unit.tensors[i].tensor) for i in [i for i, _, _ in lay.flat] + list(lay.quant))
            m = _SHARED_MASTERS.get(key)  # another executor on the same tensors built it
            if m is None or not m.backs(unit, lay):
                if any(unit.tensors[i].tensor.is_pinned() for i, _, _ in lay.flat):
                    return None  # the host page-locked them itself: copy from where they are
                m = _SHARED_MASTERS[key] = _HostMaster(unit, lay, self._place)
            self._masters[name] = m
        return m

    def _load(self, names: tuple[str, ...], buf: torch.Tensor, sync: bool) -> dict[str, _DeviceCopy]:
        """Copy the weights of units ``names`` back to back into ``buf`` (subclass tensors next
        to it): one transfer. On CUDA the copies are issued one after another on the copy stream
        (from each unit's own host master) between one wait and one event, which every unit's
        copy shares."""
        ctx = self._meter.paused() if isinstance(self._meter, CPUMeter) else contextlib.nullcontext()
        t0 = time.perf_counter()
        out: dict[str, _DeviceCopy] = {}
        masters = {n: self._master(n) if n not in self._resident_names else None for n in names}
        with ctx:
            stream_ctx = torch.cuda.stream(self._copy_stream) if self.cuda else contextlib.nullcontext()
            compute = None
            if self.cuda:
                compute = torch.cuda.current_stream(self.device)
                # The slot may still be read by kernels queued on the compute stream (or be
                # memory the allocator just recycled from them): the copy stream waits for
                # them, or it would overwrite data in use.
                ev = torch.cuda.Event()
                ev.record(compute)
                ev_start = torch.cuda.Event(enable_timing=True)
            with stream_ctx:
                if self.cuda:
                    # hazard: overwriting a slot that queued kernels (compute or host readers) still read
                    self._copy_stream.wait_event(ev)
                    ev_start.record(self._copy_stream)
                base = 0
                self._staged_bytes = 0
                for name in names:
                    out[name] = self._copy_unit(name, buf, base, masters[name], compute)
                    base += self.layout(name).nbytes
                if self.cuda:
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(self._copy_stream)
                    PINNED.staged(done, self._staged_bytes)
                    for dc in out.values():
                        dc.ready = done
                    self._events.append((ev_start, done))
                    for n, m in masters.items():
                        for owner in ([m] if m is not None else _masters_holding(self._unit(n))):
                            owner.read_by(self._copy_stream, done)
        other = sum(self.layout(n).other_bytes for n in names)
        if other:
            self._account(other)
        st = self._stats
        if st is not None:
            st.copies += 1
            st.bytes_streamed += sum(self.unit_device_bytes(n) for n in names if n not in self._resident_names)
            if not self.cuda:
                st.time_copy_s += time.perf_counter() - t0
        if self.cuda and sync:
            self._order_readers(done)
        return out

    def _copy_unit(self, name: str, buf: torch.Tensor, base: int, master: _HostMaster | None,
                   compute) -> _DeviceCopy:
        """Issue the copies of one unit's weights into ``buf`` from byte ``base`` (on CUDA on the
        copy stream, which the caller has made current; ``compute`` is the stream that reads)."""
        unit, lay = self._unit(name), self.layout(name)
        dc = _DeviceCopy()
        dc.unit = name
        src_buf, async_ok = None, False
        if master is not None and lay.nbytes:
            # a pageable master would make the copy wait for the compute stream on the host
            src_buf, async_ok = (master.buf, True) if master.pinned else _staged(master.buf, self._place)
            if src_buf is not master.buf:
                self._staged_bytes += _host_alloc_size(src_buf.numel())
        if src_buf is not None:
            buf[base:base + lay.nbytes].copy_(src_buf, non_blocking=async_ok)
            for i, off, n in lay.flat:
                dc.views[i] = _view(buf, base + off, n, unit.tensors[i].tensor)
            for i, spans in lay.quant.items():
                dc.parts[i] = _quant_views(buf, unit.tensors[i].tensor, spans, base)
        else:
            for i, off, n in lay.flat:
                src = self._host(name, i)
                v = _view(buf, base + off, n, src)
                v.copy_(src, non_blocking=self._async_from(src))
                dc.views[i] = v
            for i, spans in lay.quant.items():
                t = unit.tensors[i].tensor  # the host object (the layer sees a rebuilt one)
                views = _quant_views(buf, t, spans, base)
                for v, p in zip(views, quant.parts(t)):
                    v.copy_(p, non_blocking=self._async_from(p))
                dc.parts[i] = views
        for i in lay.other:
            src = self._host(name, i)
            dev = src.to(self._place, non_blocking=self._async_from(src), copy=True)
            if self.cuda:
                # allocated on the copy stream, used on the compute stream: keep the
                # allocator from reusing it before compute is done with it
                dev.record_stream(compute)
            dc.views[i] = dev
        return dc  # a staging buffer goes back to torch's host cache (reused after the copy)

    def _async_from(self, src: torch.Tensor) -> bool:
        """Whether a copy from ``src`` may be asynchronous: on CUDA from page-locked memory only.
        hazard: a non-blocking copy from pageable memory makes the host wait anyway (CUDA stages
        it), unseen; it is made synchronous here on purpose (pin_memory off, a master left
        pageable with no room to stage it)."""
        return self.cuda and src.is_pinned()

    def _order_readers(self, ready) -> None:
        """Every stream that reads the weights waits for the copy that put them there."""
        # hazard: compute reading a buffer before its copy has landed
        torch.cuda.current_stream(self.device).wait_event(ready)
        if self.reader_streams is not None:
            for s in self.reader_streams():
                s.wait_event(ready)  # hazard: a host offload stream casting a weight not yet copied

    def _host(self, name: str, i: int) -> torch.Tensor:
        """The host master of tensor ``i`` of unit ``name`` (what it points at when not swapped)."""
        saved = self._swapped.get(name)
        if saved is not None and i in saved:
            return saved[i]
        t = self._unit(name).tensors[i].tensor
        return t.data if is_plain_tensor(t) else t

    # -- pointer swaps -----------------------------------------------------------------------

    def _swap_in(self, name: str, dc: _DeviceCopy) -> None:
        if name in self._swapped:
            return
        unit = self._unit(name)
        saved: dict[int, torch.Tensor] = {}
        other = self.layout(name).other
        for i, dev in dc.views.items():
            ut = unit.tensors[i]
            if i not in other:
                saved[i] = ut.tensor.data
                ut.tensor.data = dev
            else:
                saved[i] = ut.tensor
                new = dev
                if isinstance(ut.tensor, nn.Parameter) and not isinstance(dev, nn.Parameter):
                    new = nn.Parameter(dev, requires_grad=ut.tensor.requires_grad)
                for r in ut.refs:
                    r.set(new)
        for i, views in dc.parts.items():  # quantized: a new object around the device parts
            ut = unit.tensors[i]
            saved[i] = ut.tensor
            new = quant.rebuild(ut.tensor, views)
            if isinstance(ut.tensor, nn.Parameter):
                # not nn.Parameter(new): on a subclass that detaches it, and comfy-kitchen's detach
                # clones the scales, reading a slot the copy stream may still be writing into
                # memory the budget does not count
                new = quant.as_parameter(new)
            for r in ut.refs:
                r.set(new)
        self._swapped[name] = saved

    def _swap_out(self, name: str) -> None:
        saved = self._swapped.pop(name, None)
        if saved is None:
            return
        unit = self._unit(name)
        lay = self.layout(name)
        other = lay.other
        for i, host in saved.items():
            ut = unit.tensors[i]
            if i not in other and i not in lay.quant:
                ut.tensor.data = host
            else:
                for r in ut.refs:
                    r.set(host)

    def _restore_all(self) -> None:
        for name in list(self._swapped):
            self._swap_out(name)

    # -- slots and scheduling ----------------------------------------------------------------

    def _slot_of(self, name: str) -> _Slot | None:
        for s in self._slots:
            if name in s.copies:
                return s
        return None

    def _load_into_slot(self, group: tuple[str, ...], slot: _Slot, sync: bool, swap: bool = True) -> None:
        """Copy a streamed group (one segment's units) into a slot as one transfer, evicting what
        it held (nothing is copied back: the host copy is the master). ``swap`` points the units'
        tensors at the slot right away."""
        if self._group_bytes(group) > slot.buf.numel():
            # a measuring plan sizes its slot over the units that can fit: this one cannot
            name = max(group, key=self.unit_device_bytes)
            raise OverBudget("weights", name, self.unit_device_bytes(name), self._act_seen,
                             self._plan.budget_bytes if self._plan else 0)
        for old in slot.copies:
            self._swap_out(old)
        self._account(-self._slot_other_bytes(slot))
        slot.copies = {}
        slot.copies = self._load(group, slot.buf, sync=sync)
        if swap:
            for n, dc in slot.copies.items():
                self._swap_in(n, dc)

    def _prefetch_first(self, plan: Plan) -> None:
        groups = plan.streamed_groups
        if not groups or self._slot_of(groups[0][0]) is not None or len(self._slots) < 2:
            return
        # after the forward: the tensors stay on their masters until the next forward starts
        self._load_into_slot(groups[0], self._other_slot(self._last_streamed), sync=False, swap=False)

    def _other_slot(self, busy: tuple[str, ...] | None) -> _Slot:
        """A slot not holding ``busy`` (the group running or just run)."""
        for s in self._slots:
            if not s.copies:
                return s
        for s in self._slots:
            if s.group != busy:
                return s
        return self._slots[0]

    def _enter(self, name: str, module: nn.Module | None = None) -> None:
        if not self._running:
            return  # hooks held between forwards: someone else is running these modules
        if self._meas is not None and module is not None:
            self._entered_modules.add(id(module))  # which parts of a unit ran (for finer cuts)
        if name == self._current:
            return
        if self._meter is not None:
            self._close_window()
        self._current = name
        if self._meter is not None:
            live = self._meter.live() + self._input_bytes
            m = self._meas.get(name)
            if m is None:
                self._meas[name] = UnitMeasurement(live, live)
                self._order.append(name)
            else:
                m.calls += 1
                m.entry_bytes = max(m.entry_bytes, live)
            if self.cuda:  # the meter resets the allocator's peak per unit: keep the forward's
                self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device))
            self._meter.reset_peak()
        if name not in self._resident_names:
            slot = self._slot_of(name)
            if slot is None:
                # not prefetched (first forward, a skipped or repeated block): load its group now
                if self._stats is not None:
                    self._stats.sync_loads += 1
                slot = self._other_slot(self._last_streamed)
                a = self._cuda_mark()
                self._load_into_slot(self._group_of.get(name, (name,)), slot, sync=True)
                if a is not None:
                    self._waits.append((a, self._cuda_mark()))
            elif self.cuda and slot.copies[name].ready is not None:
                ready = slot.copies[name].ready
                # compute must not read the slot before its copy has landed
                if not ready.query():
                    a = self._cuda_mark()
                    self._order_readers(ready)
                    self._waits.append((a, self._cuda_mark()))
                for dc in slot.copies.values():  # one event for the group: ordered for all of it
                    dc.ready = None
            self._last_streamed = slot.group
            self._loaded(name, slot.copies[name])
        nxt = self._next.get(name)
        if nxt is not None and len(self._slots) >= 2 and self._slot_of(nxt[0]) is None:
            self._load_into_slot(nxt, self._other_slot(self._last_streamed), sync=not self.cuda)

    def _loaded(self, name: str, dc: _DeviceCopy) -> None:
        """Run ``on_loaded`` once per device copy, when the copy is usable by compute."""
        if self.on_loaded is None or dc.patched:
            return
        dc.patched = True
        # not paused for the meter: what the hook allocates (a merge's temporaries) is device
        # memory the unit's window really uses
        with self.alloc_context():
            self.on_loaded(self._unit(name))

    def _cuda_mark(self):
        """A timing event on the compute stream (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _install_hooks(self, plan: Plan) -> None:
        """Pre-hooks that enter each unit. While buffers are held between forwards they stay
        (and do nothing outside a forward of ours: the host may run the same modules for a
        clone that is not ours); they are removed on release, after an error, and when a new
        plan cuts the module differently."""
        key = tuple(u.name for u in plan.units)
        if self._hooks and self._hooked == key:
            return
        self._remove_hooks()
        self._hooked = key
        hooks = self._hooks
        ref = weakref.ref(self)  # hooks must not keep a dropped executor (and its pinned masters) alive
        for pu in plan.units:
            unit = self._unit(pu.name)
            name = pu.name

            def pre(mod, _args, _name=name, _ref=ref):
                ex = _ref()
                if ex is not None:
                    ex._enter(_name, mod)

            for m in unit.hook_modules:
                hooks.append(m.register_forward_pre_hook(pre))

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._hooked = None

    # -- hook dispatch: which modules tell the executor that a unit runs ---------------------

    def _hook_units(self, plan: Plan, measuring: bool) -> None:
        """Pre-hooks that enter units, as few as the forward needs.

        A measuring forward hooks every module that reads a unit's tensors (it records entry
        order, the modules each unit ran, and activations per unit), and watches whether every
        call of a unit's modules happened inside a call of one of the unit's roots. Any other
        forward hooks only streamed units (entering a resident unit does nothing but what the
        previous streamed unit's entry already did), and of a streamed unit only its roots when
        every measuring forward saw it contained that way; else (a UNet's timestep-embed
        sequential calls its children directly, a unit never measured) every module, as before.
        Kept while buffers are held; replaced when the set to hook changes."""
        if measuring:
            self._roots_active.clear()
            self._uncontained.clear()
            spec: tuple = ("measure",) + tuple(u.name for u in plan.units)
        else:
            resident = self._resident_names
            spec = ("run",) + tuple((u.name, self._contained.get(u.name, False))
                                    for u in plan.units if u.name not in resident)
        if self._hooked == spec:
            return
        self._remove_hooks()
        self._hooked = spec
        hooks = self._hooks
        ref = weakref.ref(self)  # hooks must not keep a dropped executor (and its pinned masters) alive
        for pu in plan.units:
            name = pu.name
            unit = self._unit(name)
            if measuring:
                roots = frozenset(id(m) for _, m in unit.roots)

                def pre_m(mod, _args, _name=name, _roots=roots, _ref=ref):
                    ex = _ref()
                    if ex is None:
                        return
                    if ex._running and id(mod) not in _roots and not ex._roots_active.get(_name):
                        ex._uncontained.add(_name)  # a module of the unit ran outside its roots
                    ex._enter(_name, mod)

                def root_in(_mod, _args, _name=name, _ref=ref):
                    ex = _ref()
                    if ex is not None and ex._running:
                        ex._roots_active[_name] = ex._roots_active.get(_name, 0) + 1

                def root_out(_mod, _args, _out, _name=name, _ref=ref):
                    ex = _ref()
                    if ex is not None and ex._running and ex._roots_active.get(_name):
                        ex._roots_active[_name] -= 1

                for m in unit.hook_modules:
                    hooks.append(m.register_forward_pre_hook(pre_m))
                for _, r in unit.roots:
                    hooks.append(r.register_forward_pre_hook(root_in))
                    hooks.append(r.register_forward_hook(root_out, always_call=True))
                continue
            if name in self._resident_names:
                continue

            def pre(mod, _args, _name=name, _ref=ref):
                ex = _ref()
                if ex is not None:
                    ex._enter(_name, mod)

            mods = [m for _, m in unit.roots] if self._contained.get(name) else unit.hook_modules
            for m in mods:
                hooks.append(m.register_forward_pre_hook(pre))

    def _learn_containment(self) -> None:
        """After a measuring forward: a unit stays root-entered only if every measuring forward
        that entered it saw each of its module calls inside a call of one of its roots."""
        for n in self._order:
            ok = bool(self._unit(n).roots) and n not in self._uncontained
            self._contained[n] = self._contained.get(n, True) and ok

    # -- held weights: an all-resident plan between forwards ---------------------------------

    @property
    def holds_weights(self) -> bool:
        """The module's tensors point at the executor's device copies between forwards."""
        return self._held is not None

    def restore_weights(self) -> None:
        """Point every tensor back at its master now (device buffers stay for the next forward)."""
        if self._running:
            raise RuntimeError("cannot restore the weights while a forward runs")
        self._drop_held()

    def _resume_held(self, plan: Plan, measure: bool) -> bool:
        """A forward of the plan whose weights are held: nothing to swap, nothing to hook."""
        if self._held is None:
            return False
        if self._held is plan and not measure and not self._stale_copies:
            self._plan = plan
            return True
        self._drop_held()
        return False

    def _after_forward(self, plan: Plan, ok: bool) -> None:
        """Point tensors back at their masters, or keep an all-resident plan swapped in for the
        next forward of the session (only where nothing is measured and nothing streams)."""
        if ok and self._meas is not None:
            self._learn_containment()
        if ok and self._held is plan:
            return
        self._drop_held()  # a held plan's forward failed
        if (ok and self._meter is None and not self._stale_copies and plan.slots == 0
                and (self._in_session or (self.keep_buffers and self.hold_weights))
                and not plan.streamed_order and all(n in self._resident for n in self._swapped)):
            self._hold(plan)
            return
        self._restore_all()

    def _hold(self, plan: Plan) -> None:
        self._remove_hooks()  # nothing streams: no unit needs entering
        self._held = plan
        undo = self._held_undo
        undo.clear()
        for name, saved in self._swapped.items():
            unit, lay = self._unit(name), self.layout(name)
            for i, host in saved.items():
                undo.append((unit.tensors[i], host, i not in lay.other and i not in lay.quant))
        mod = self._module() if self._module is not None else None
        if mod is not None:
            ref = weakref.ref(self)

            def guard(_mod, _args, _ref=ref):
                ex = _ref()
                if ex is not None and not ex._running:
                    ex._drop_held()  # a forward that is not ours reads the masters

            self._guard.append(mod.register_forward_pre_hook(guard))

    def _drop_held(self) -> None:
        if self._held is None:
            return
        self._held = None
        self._held_undo.clear()
        for h in self._guard:
            h.remove()
        self._guard.clear()
        self._restore_all()

    # -- measurement and stats ---------------------------------------------------------------

    def _make_meter(self, measure: bool) -> Meter | None:
        if self.cuda:
            return CUDAMeter(self.device, self._own_bytes_relative) if measure else None
        if measure or self.track_cpu_memory:
            return CPUMeter(check=self._check_live if self._limit is not None else None)
        return None

    def _own_bytes_relative(self) -> int:
        return self.device_bytes + self._base

    def _close_window(self) -> None:
        cur = self._current
        if cur is None or self._meas is None:
            return
        m = self._meas[cur]
        m.peak_bytes = max(m.peak_bytes, self._meter.peak() + self._input_bytes)

    def _finish_measure(self) -> dict[str, UnitMeasurement] | None:
        if self._meter is None:
            return None
        self._close_window()
        for n in self._order:
            self._meas[n].modules = frozenset(
                id(m) for m in self._unit(n).hook_modules if id(m) in self._entered_modules)
        return {n: self._meas[n] for n in self._order}

    def _collect_cuda_stats(self, stats: RunStats, start_ev, end_ev) -> None:
        # Nothing is waited for here (the CPU runs ahead into the next forward): events that
        # have completed are timed now, the others when a later forward ends.
        if self._reset_peak:
            # (the allocator's statistics are kept by the host at each allocation: reading them
            # needs no wait for the kernels)
            # the meter resets the allocator's peak per unit: the forward's peak is the largest seen
            stats.peak_device_bytes = max(max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device)) - self._base,
                                          torch.cuda.max_memory_reserved(self.device) - self._base_reserved)
        done, pending = [], []
        for pair in self._events:
            (done if pair[1].query() else pending).append(pair)
        self._events = pending
        stats.time_copy_s = sum(a.elapsed_time(b) for a, b in done) / 1e3
        waited = [p for p in self._waits if p[1].query()]
        self._waits = [p for p in self._waits if p not in waited]
        stats.time_wait_s += sum(a.elapsed_time(b) for a, b in waited) / 1e3
        if start_ev is not None:
            self._timing.append((start_ev, end_ev))
        timed = [p for p in self._timing if p[1].query()]
        self._timing = [p for p in self._timing if p not in timed]
        total = sum(a.elapsed_time(b) for a, b in timed) / 1e3
        stats.time_compute_s = max(0.0, total - stats.time_wait_s)


def _input_bytes(args, kwargs, device: torch.device) -> int:
    """Bytes of the tensors passed into the forward that live on the compute device."""
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten((args, kwargs))
    seen, total = set(), 0
    for t in flat:
        if isinstance(t, torch.Tensor) and t.device.type == device.type and not t.is_meta:
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:
                continue
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


def _finalize_executor(copy_stream, hooks: list, masters: dict) -> None:
    """An executor collected without ``release``: hooks off the module, its masters dropped (the
    last owner's drop unpins one, after the copies that read it)."""
    if copy_stream is not None:
        copy_stream.synchronize()  # hazard: buffers freed with this executor while copies write them
    for h in hooks:
        h.remove()
    hooks.clear()
    masters.clear()  # a master no other executor shares is unpinned by its own finalizer


def _undo_held(undo: list, guard: list) -> None:
    """An executor collected while it held weights: the module points at its masters again."""
    for h in guard:
        h.remove()
    guard.clear()
    for ut, host, plain in undo:
        if plain:
            ut.tensor.data = host
        else:
            for r in ut.refs:
                r.set(host)
    undo.clear()
