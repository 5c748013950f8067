"""The segmented executor: runs a module's forward under a plan.

Mechanics (the same on CPU and CUDA, so CPU tests exercise all of it):

* Host masters. A unit's tensors stay where the model keeps them. On CUDA, a streamed unit's
  plain tensors are moved once into one exact-size flat host buffer per unit, page-locked with
  ``cudaHostRegister`` where possible; the parameters then live there, so that buffer *is* the
  master: no second host copy, and nothing is ever copied back on eviction. On CPU, or where
  pinning fails, the tensors are their own masters and are copied one by one.
* Device memory it owns. Resident units get one flat device buffer each; streamed units cycle
  through (at most) two slot buffers of the plan's slot size. Every byte placed on the device is
  counted (``device_bytes``, ``peak_weight_bytes``).
* Pointer swaps. While a unit's weights are on the device, its parameters' ``.data`` point at
  views of the executor's buffers (tensor subclasses are swapped as objects, their metadata
  intact); afterwards they point back at their masters. The Parameter objects never change.
* Scheduling by unit. Forward pre-hooks on every module that reads a unit's tensors tell the
  executor which unit runs; nothing counts calls, so skipped blocks, replaced blocks and blocks
  run twice are all fine. Entering a streamed unit waits for its copy (or loads it then), and
  starts copying the next streamed unit into the other slot.
* Prefetch (CUDA). Copies run on a side stream. Compute waits only on the event of the copy it
  needs, and a copy into a slot first waits on an event recorded on the compute stream, so it
  never overwrites weights that queued kernels still read.
* Exact restore. Hooks are removed and every tensor is pointed back at its master in
  ``finally``: after a forward, an exception or an interrupt the module is as it was.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import torch
from torch import nn

from .measure import CPUMeter, CUDAMeter, Meter, OverBudget, UnitMeasurement
from .plan import Plan
from .report import RunStats
from .tensors import align_up, is_plain_tensor, tensor_nbytes
from .units import Unit


@dataclasses.dataclass
class _Layout:
    """Where a unit's plain tensors sit in a flat buffer, and its subclass tensors."""

    flat: list[tuple[int, int, int]]   # (index into unit.tensors, byte offset, nbytes)
    other: list[int]                   # indices of tensors moved one by one (subclasses)
    nbytes: int                        # flat buffer size (aligned)
    other_bytes: int


def _layout(unit: Unit) -> _Layout:
    flat, other, off, other_bytes = [], [], 0, 0
    for i, ut in enumerate(unit.tensors):
        if is_plain_tensor(ut.tensor) and ut.tensor.is_contiguous():
            n = ut.tensor.numel() * ut.tensor.element_size()
            flat.append((i, off, n))
            off = align_up(off + n)
        else:
            other.append(i)
            other_bytes += tensor_nbytes(ut.tensor)
    return _Layout(flat, other, off, other_bytes)


def _view(buf: torch.Tensor, off: int, n: int, like: torch.Tensor) -> torch.Tensor:
    return buf[off:off + n].view(like.dtype).view(like.shape)


class _HostMaster:
    """One unit's plain tensors in a single flat host buffer, page-locked when possible."""

    def __init__(self, unit: Unit, layout: _Layout) -> None:
        self.buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        self.pinned = False
        for i, off, n in layout.flat:
            t = unit.tensors[i].tensor
            _view(self.buf, off, n, t).copy_(t.data)
        for i, off, n in layout.flat:  # the flat buffer is now the master: drop the old storage
            t = unit.tensors[i].tensor
            t.data = _view(self.buf, off, n, t)
        if self.buf.numel():
            try:
                err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
                self.pinned = int(getattr(err, "value", err)) == 0
            except Exception:
                self.pinned = False

    def backs(self, unit: Unit, layout: _Layout) -> bool:
        """Do the unit's tensors still live in this buffer?"""
        base = self.buf.data_ptr()
        return all(unit.tensors[i].tensor.data_ptr() == base + off for i, off, _ in layout.flat)

    def release(self) -> None:
        """Unpin; the tensors keep living in the (now pageable) buffer."""
        if self.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            except Exception:
                pass
            self.pinned = False


class _DeviceCopy:
    """A unit's weights on the device: views into a flat buffer plus subclass tensors."""

    def __init__(self) -> None:
        self.unit: str | None = None
        self.views: dict[int, torch.Tensor] = {}     # tensor index -> device tensor
        self.ready: object | None = None             # CUDA event of the copy, or None


@dataclasses.dataclass
class _Slot:
    buf: torch.Tensor
    copy: _DeviceCopy


class SegmentedExecutor:
    """Runs forwards of ``module`` under plans; owns the device buffers of one module.

    ``units`` maps a unit name to its ``Unit`` (split units included). Use as::

        with executor.session():
            out, stats, meas = executor.forward(plan, fn, *args, **kwargs)
    """

    def __init__(self, units: Callable[[str], Unit], device: torch.device | str,
                 pin_memory: bool | None = None, track_cpu_memory: bool = False) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
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
        self._next: dict[str, str | None] = {}
        self._resident_names: set[str] = set()
        self._current: str | None = None
        self._last_streamed: str | None = None
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
        try:
            self._begin(plan)
            self._meter = self._make_meter(measure)
            self._meas = {} if self._meter is not None else None
            self._order = []
            self._entered_modules = set()
            # inputs count as activations; walked only when measuring (not on every forward)
            self._input_bytes = _input_bytes(args, kwargs, self.device) if self._meter is not None else 0
            if self._meter is not None:
                self._meter.start()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
                self._base = torch.cuda.memory_allocated(self.device) - self.device_bytes
                start_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record()
            self._install_hooks(plan)
            if self.cuda and self._limit is not None:
                # the allocator cannot call back: check between module calls while measuring
                check = lambda *_a: self._check_live()  # noqa: E731
                global_hooks = [nn.modules.module.register_module_forward_pre_hook(check),
                                nn.modules.module.register_module_forward_hook(check)]
            out = fn(*args, **kwargs)
            ok = True
            return out, stats, self._finish_measure()
        finally:
            for h in global_hooks:
                h.remove()
            if not ok:
                self.failed_unit, self.failed_device_bytes, self.failed_plan = self._current, self.device_bytes, plan
            if not ok or not self._holding:
                self._remove_hooks()
            if self._meter is not None:
                self._meter.stop()
            self._restore_all()
            self._current = self._last_streamed = None
            try:
                if ok and plan.slots == 2 and self._holding:
                    self._prefetch_first(plan)  # wrap around: ready for the next forward
                if self.cuda:
                    end_ev = torch.cuda.Event(enable_timing=True)
                    end_ev.record()
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
            self._copy_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self._remove_hooks()
        self._restore_all()
        self._resident.clear()
        self._slots.clear()
        for m in self._masters.values():
            m.release()
        self._masters.clear()
        self._events.clear()
        self.device_bytes = 0

    def forget_units(self) -> None:
        """Drop layouts and masters (the module's tensors were replaced from outside)."""
        self.release()
        self._layouts.clear()

    # -- buffers ---------------------------------------------------------------------------

    def _alloc(self, nbytes: int) -> torch.Tensor:
        ctx = self._meter.paused() if isinstance(self._meter, CPUMeter) else contextlib.nullcontext()
        with ctx:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
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
        # free what the new plan no longer keeps, before allocating anything new
        for name in [n for n in self._resident if n not in resident]:
            buf, dc = self._resident.pop(name)
            self._account(-buf.numel() - self._other_bytes(dc))
        want_slots = plan.slots
        if len(self._slots) > want_slots or any(s.buf.numel() != plan.slot_bytes for s in self._slots):
            if self.cuda:
                self._copy_stream.synchronize()
            for s in self._slots:
                self._account(-s.buf.numel() - self._other_bytes(s.copy))
            self._slots = []
        for s in self._slots:  # a unit the new plan keeps resident must not also sit in a slot
            if s.copy.unit in resident:
                self._account(-self._other_bytes(s.copy))
                s.copy = _DeviceCopy()
        self._resident_names = resident
        for name in plan.resident_units:
            if name not in self._resident:
                buf = self._alloc(self.layout(name).nbytes)
                dc = self._load(name, buf, sync=True)
                self._resident[name] = (buf, dc)
        while len(self._slots) < want_slots:
            self._slots.append(_Slot(self._alloc(plan.slot_bytes), _DeviceCopy()))
        order = plan.streamed_order
        nxt: dict[str, str | None] = {}
        # next streamed unit after each unit, in execution order (wrapping to the first)
        names = [u.name for u in plan.units]
        pos = {n: i for i, n in enumerate(order)}
        upcoming = order[0] if order else None
        for name in reversed(names):
            nxt[name] = upcoming
            if name in pos:
                upcoming = name
        for name in names:
            if name in pos:
                nxt[name] = order[(pos[name] + 1) % len(order)] if len(order) > 1 else None
        self._next = nxt
        for name, (_, dc) in self._resident.items():
            self._swap_in(name, dc)
        for s in self._slots:
            if s.copy.unit is not None:
                self._swap_in(s.copy.unit, s.copy)
        if (order and plan.slots and self._slot_of(order[0]) is None
                and self.layout(order[0]).nbytes <= plan.slot_bytes):  # a measuring slot may not hold it
            self._load_into_slot(order[0], self._slots[0], sync=not self.cuda)

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
            m.release()  # someone moved the tensors since (another engine, the host): rebuild
            m = None
        if m is None:
            if not lay.flat or any(unit.tensors[i].tensor.is_pinned() for i, _, _ in lay.flat):
                return None
            m = self._masters[name] = _HostMaster(unit, lay)
        return m

    def _load(self, name: str, buf: torch.Tensor, sync: bool) -> _DeviceCopy:
        """Copy unit ``name``'s weights into ``buf`` (and subclass tensors next to it)."""
        unit, lay = self._unit(name), self.layout(name)
        dc = _DeviceCopy()
        dc.unit = name
        streamed = name not in self._resident_names
        master = self._master(name) if streamed else None
        ctx = self._meter.paused() if isinstance(self._meter, CPUMeter) else contextlib.nullcontext()
        t0 = time.perf_counter()
        with ctx:
            stream_ctx = torch.cuda.stream(self._copy_stream) if self.cuda else contextlib.nullcontext()
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
                    self._copy_stream.wait_event(ev)
                    ev_start.record(self._copy_stream)
                if master is not None and lay.nbytes:
                    buf[:lay.nbytes].copy_(master.buf, non_blocking=master.pinned)
                    for i, off, n in lay.flat:
                        dc.views[i] = _view(buf, off, n, unit.tensors[i].tensor)
                else:
                    for i, off, n in lay.flat:
                        src = self._host(name, i)
                        v = _view(buf, off, n, src)
                        v.copy_(src, non_blocking=self.cuda)
                        dc.views[i] = v
                for i in lay.other:
                    src = self._host(name, i)
                    dev = src.to(self.device, non_blocking=self.cuda)
                    if self.cuda:
                        # allocated on the copy stream, used on the compute stream: keep the
                        # allocator from reusing it before compute is done with it
                        dev.record_stream(compute)
                    dc.views[i] = dev
                if self.cuda:
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(self._copy_stream)
                    dc.ready = done
                    self._events.append((ev_start, done))
        if lay.other:
            self._account(lay.other_bytes)
        st = self._stats
        if st is not None:
            st.copies += 1
            if streamed:
                st.bytes_streamed += lay.nbytes + lay.other_bytes
            if not self.cuda:
                st.time_copy_s += time.perf_counter() - t0
        if self.cuda and sync:
            torch.cuda.current_stream(self.device).wait_event(dc.ready)
        return dc

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
        self._swapped[name] = saved

    def _swap_out(self, name: str) -> None:
        saved = self._swapped.pop(name, None)
        if saved is None:
            return
        unit = self._unit(name)
        other = self.layout(name).other
        for i, host in saved.items():
            ut = unit.tensors[i]
            if i not in other:
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
            if s.copy.unit == name:
                return s
        return None

    def _load_into_slot(self, name: str, slot: _Slot, sync: bool, swap: bool = True) -> None:
        """Copy a unit into a slot, evicting what it held (nothing is copied back: the host
        copy is the master). ``swap`` points the unit's tensors at the slot right away."""
        if self.layout(name).nbytes > slot.buf.numel():
            # a measuring plan sizes its slot over the units that can fit: this one cannot
            raise OverBudget("weights", name, self.unit_device_bytes(name), self._act_seen,
                             self._plan.budget_bytes if self._plan else 0)
        old = slot.copy.unit
        if old is not None:
            self._swap_out(old)
            self._account(-self._other_bytes(slot.copy))
        slot.copy = _DeviceCopy()
        slot.copy = self._load(name, slot.buf, sync=sync)
        if swap:
            self._swap_in(name, slot.copy)

    def _prefetch_first(self, plan: Plan) -> None:
        order = plan.streamed_order
        if not order or self._slot_of(order[0]) is not None or len(self._slots) < 2:
            return
        # after the forward: the tensors stay on their masters until the next forward starts
        self._load_into_slot(order[0], self._other_slot(self._last_streamed), sync=False, swap=False)

    def _other_slot(self, busy: str | None) -> _Slot:
        """A slot not holding ``busy`` (the unit running or just run)."""
        for s in self._slots:
            if s.copy.unit is None:
                return s
        for s in self._slots:
            if s.copy.unit != busy:
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
                # not prefetched (first forward, a skipped or repeated block): load it now
                if self._stats is not None:
                    self._stats.sync_loads += 1
                slot = self._other_slot(self._last_streamed)
                a = self._cuda_mark()
                self._load_into_slot(name, slot, sync=True)
                if a is not None:
                    self._waits.append((a, self._cuda_mark()))
            elif self.cuda and slot.copy.ready is not None:
                # compute must not read the slot before its copy has landed
                if not slot.copy.ready.query():
                    a = self._cuda_mark()
                    torch.cuda.current_stream(self.device).wait_event(slot.copy.ready)
                    self._waits.append((a, self._cuda_mark()))
                slot.copy.ready = None
            self._last_streamed = name
        nxt = self._next.get(name)
        if nxt is not None and len(self._slots) >= 2 and self._slot_of(nxt) is None:
            self._load_into_slot(nxt, self._other_slot(self._last_streamed), sync=not self.cuda)

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
        for pu in plan.units:
            unit = self._unit(pu.name)
            enter = self._enter
            name = pu.name

            def pre(mod, _args, _name=name, _enter=enter):
                _enter(_name, mod)

            for m in unit.hook_modules:
                hooks.append(m.register_forward_pre_hook(pre))

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hooked = None

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
        # The forward's own kernels must be done to time it (the caller reads the output next
        # anyway). The copy stream is not waited for: the prefetch for the next forward keeps
        # running, and copies still in flight are counted when they have landed.
        end_ev.synchronize()
        done, pending = [], []
        for pair in self._events:
            (done if pair[1].query() else pending).append(pair)
        self._events = pending
        stats.time_copy_s = sum(a.elapsed_time(b) for a, b in done) / 1e3
        stats.time_wait_s += sum(a.elapsed_time(b) for a, b in self._waits) / 1e3
        if start_ev is not None:
            total = start_ev.elapsed_time(end_ev) / 1e3
            stats.time_compute_s = max(0.0, total - stats.time_wait_s)
        stats.peak_device_bytes = max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device)) - self._base
        self._waits.clear()


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
