"""The segmented executor: runs a module's forward under a plan, on CPU and CUDA alike (so CPU
tests exercise all of it).

It orchestrates one forward and owns only what spans the rooms: the session (buffers kept
between forwards), the plan switch, which unit runs (entered through ``unit_hooks``: nothing
counts calls, so skipped, replaced and repeated blocks are fine), the held-plan policy (inside
a session, or with ``hold_weights``, an all-resident plan keeps its weights swapped in between
forwards), release, ``invalidate`` and the failure bookkeeping. The resources live beside it in
``runtime``, one owner each, and their module docstrings say what each owns and the rule it
keeps: ``host_memory`` (masters, page-locking, the bounce buffer of file-backed weights),
``device_memory`` (buffers, slots, byte counts), ``transfers`` (copy stream, events, reader
ordering, copy timing), ``schedule_walk`` (the plan's schedule walked at each unit entry: a
slot's free event recorded when its group is done, the next copy into it issued then; a group
not in its slot when entered copied at once; the copies issued for the next call), ``binding``
(pointer swaps, held weights), ``unit_hooks`` and ``measuring`` (one forward's measurement).

The one rule: after a forward, an exception or an interrupt the module is exactly as it was
(hooks removed, every tensor pointed back at its master in ``finally``), held weights excepted,
which go back on release, ``rest`` (the end of a run), an error, ``invalidate``, a new plan and
any forward not ours.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Callable

import torch
from torch import nn

from ..planning.plan import Plan
from ..planning.report import RunStats
from .binding import Binding
from .device_memory import DeviceCopy, DeviceMemory
from .host_memory import PAGE_LOCKED, HostMasters
from .measuring import Measuring
from .schedule_walk import ScheduleWalk
from .transfers import Transfers
from .unit_hooks import UnitHooks
from ..model.units import Unit

class _OnOneModule:
    """The executors on each module: they hold device buffers one at a time (two nodes on one
    model), so before one allocates, the others give theirs back and the device never holds both
    budgets. Executors of one engine on several devices (one ``group``) coexist."""

    def __init__(self) -> None:
        self._by_module: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()

    def add(self, module: nn.Module, executor: "SegmentedExecutor") -> None:
        self._by_module.setdefault(module, weakref.WeakSet()).add(executor)

    def release_others(self, module: nn.Module | None, executor: "SegmentedExecutor") -> None:
        for other in list(self._by_module.get(module, ())) if module is not None else ():
            if other is not executor and not other.running and other.device_bytes and (
                    other.group is None or other.group is not executor.group):
                other.release()


_EXECUTORS = _OnOneModule()


def _delegate(room: str, attr: str, doc: str) -> property:
    """An attribute of the executor that belongs to one of its rooms."""
    return property(lambda self: getattr(getattr(self, room), attr),
                    lambda self, v: setattr(getattr(self, room), attr, v), doc=doc)


class SegmentedExecutor:
    """Runs forwards of ``module`` under plans; owns the device buffers of one module.

    ``units`` maps a unit name to its ``Unit`` (split units included). Use as::

        with executor.session():
            out, stats, meas = executor.forward(plan, fn, *args, **kwargs)
    """

    device_bytes = _delegate("memory", "bytes", "Device bytes the executor holds now.")
    peak_weight_bytes = _delegate("memory", "peak", "This forward's peak of device bytes held.")

    def __init__(self, units: Callable[[str], Unit], device: torch.device | str,
                 pin_memory: bool | None = None, track_cpu_memory: bool = False,
                 module: nn.Module | None = None, keep_file_backed: bool = False,
                 alloc_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 reader_streams: Callable[[], list] | None = None,
                 page_lock_room: Callable[[], int] | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._unit = units
        self.track_cpu_memory = track_cpu_memory  # meter every CPU forward (slow), not only measured ones
        if page_lock_room is not None:
            PAGE_LOCKED.room = page_lock_room  # the process's one ledger follows the host's limit
        # the rooms; each registers the finalizer for what it owns
        self.memory = DeviceMemory(units, self.device, alloc_context)
        pin = self.cuda if pin_memory is None else (pin_memory and self.cuda)
        self.masters = HostMasters(units, self.memory.layout, pin, self.memory.place, keep_file_backed, self.cuda)
        self.binding = Binding(units, self.memory.layout)
        self.transfers = Transfers(self.device, self.memory, self.masters, self.binding, units, reader_streams)
        self.hooks = UnitHooks(units, self)
        self.measuring = Measuring(self.device, self.memory, units)
        self.walk = ScheduleWalk(self.memory, self.transfers, self.binding, self.measuring)
        self._in_session = 0
        self.keep_buffers = False   # hold device buffers between forwards until release()
        # an all-resident plan keeps its weights swapped in between forwards of a session (or with
        # ``hold_weights``); whole again on release, error, invalidate, a new plan, a foreign forward
        self.hold_weights = False
        self._running = False
        self._current: str | None = None
        # the unit that ran when the last forward raised, the bytes the executor held then, the plan
        self.failed_unit, self.failed_device_bytes, self.failed_plan = None, 0, None
        self.failed_tracked = True    # the failed forward tracked every unit (not only streamed ones)
        # Called with a unit once a fresh copy of its weights is usable by compute, before any
        # of its modules runs: the host merges weight patches (LoRA) into the device copy there.
        self.on_loaded: Callable[[Unit], None] | None = None
        self._stale_copies = False
        self.group = None  # the executors of one engine on several devices (they coexist)
        if module is not None:
            _EXECUTORS.add(module, self)
        self._module = weakref.ref(module) if module is not None else None

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
                self.binding.drop_held()  # buffers kept past the session; the weights are not

    def forward(self, plan: Plan, fn: Callable, *args, measure: bool = False,
                limit_bytes: int | None = None, clock: bool = False, **kwargs):
        """Run ``fn(*args, **kwargs)`` (a forward of the module) under ``plan``.

        Returns ``(output, stats, measurements)``; measurements (per unit, activation bytes) only
        when ``measure`` is true, else None. With ``limit_bytes`` (measuring forwards) the forward
        is stopped with ``OverBudget`` as soon as weights on the device plus live activations
        pass it (on CPU at the allocation that would pass it; on CUDA at the next module call),
        or when it enters a unit larger than the plan's slot. With ``clock`` (a timed forward)
        every unit is hooked, resident ones too, and timed without a meter (``take_clock``): a
        CPU meter runs Python at every operator, which a measuring forward's times would carry.
        """
        if self._running:
            raise RuntimeError("SegmentedExecutor.forward is not re-entrant")
        self._running = True
        stats = RunStats(forwards=1)
        self.walk.start(stats, plan)
        ok = False
        t0 = time.perf_counter()
        start_ev = None
        ms = self.measuring
        ms.reset(limit_bytes if measure else None)
        self.memory.on_grow = self._check_live if ms.limit is not None else None
        self.failed_unit = None
        self.peak_weight_bytes = self.device_bytes  # this forward's peak, not the executor's lifetime's
        global_hooks = []
        capped = None   # the allocator's fraction to restore after a capped measuring forward
        try:
            _EXECUTORS.release_others(self._module() if self._module is not None else None, self)
            self.masters.tiers.check()  # the weights files are as they were (disk-tier units)
            if self.cuda:
                start_ev = ms.start_cuda()
            resumed = self.binding.resume(plan, not measure and not clock and not self._stale_copies)
            if not resumed:
                self._begin(plan)
            if self.cuda:
                ms.base = torch.cuda.memory_allocated(self.device) - self.device_bytes
            ms.start_meter(measure, self.track_cpu_memory, self._check_live, clock, (args, kwargs))
            if self.cuda:
                capped = ms.cap_cuda(self.device_bytes + ms.input_bytes)
            if not resumed:
                self.hooks.install(plan, ms.meas is not None, set() if clock else self.walk.unhooked())
            global_hooks = ms.limit_hooks_cuda(lambda *_a: self._check_live())
            out = fn(*args, **kwargs)
            ok = True
            return out, stats, ms.finish()
        except torch.OutOfMemoryError:
            if capped is None or (self.group is not None and self._current is None):
                # (a device of the group none of whose units has run yet: the error is another
                # device's, which that device's executor, further out, names by its unit)
                raise
            raise ms.over_cap(self._current) from None  # a finer cut, never a peak over the budget
        finally:
            ms.uncap_cuda(capped)
            for h in global_hooks:
                h.remove()
            if not ok:
                self.failed_unit, self.failed_device_bytes, self.failed_plan = self._current, self.device_bytes, plan
                self.failed_tracked = ms.meas is not None
            if not ok or not self._holding:
                self.hooks.remove()
            elif clock:  # a timed forward hooked the resident units too: back to the steady hooks
                self.hooks.install(plan, False, self.walk.unhooked())
            ms.stop_meter()
            self._after_forward(plan, ok)
            self.walk.end(ok, self._holding)
            self._current = None
            try:
                if ok and plan.slots == 2 and self._holding:
                    self.walk.prefetch_first(plan)  # wrap around: ready for the next forward
                if self.cuda:
                    self.transfers.times.collect_cuda_times(stats, start_ev, ms.end_cuda(stats))
                else:
                    ms.cpu_stats(stats, time.perf_counter() - t0)
                stats.peak_weight_bytes = self.peak_weight_bytes
            finally:
                ms.meter, ms.limit = None, None
                self.memory.pause = contextlib.nullcontext
                self.memory.on_grow = None
                self._running = False
                self.walk.plan = None
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
        self.transfers.drain()
        self.walk.drop_ahead()
        self.hooks.remove()
        self.binding.drop_held()
        self.binding.restore_all()
        # host masters stay (pinned, owned for the process): the next session streams at once
        self.transfers.times.forget()
        self._stale_copies = False
        self.memory.clear()

    def rest(self) -> None:
        """Between runs: the module whole again (held weights pointed back at their masters, no
        hooks on it); the device buffers and the copies in them stay for the next forward, which
        installs its hooks again and copies nothing it still holds."""
        if self._running:
            raise RuntimeError("cannot rest while a forward runs")
        self.binding.drop_held()
        self.hooks.remove()

    def invalidate(self) -> None:
        """The host writes (or wrote) into the weights in place (hook LoRAs): device copies held
        between forwards are stale; the next forward copies them again. Called before the write,
        it also makes the write safe."""
        self.transfers.wait_copies()  # hazard: the host writing masters a prefetch still reads
        if not self._running:
            self.binding.drop_held()  # the host writes into (and reads) its masters, not our device copies
        self._stale_copies = True

    def forget_units(self) -> None:
        """Drop layouts and masters (the module's tensors were replaced from outside)."""
        self.release()
        self.masters.forget()
        self.memory.forget_layouts()

    def take_clock(self):
        """The unit clock of the last measured forward that finished (``runtime.measuring.UnitClock``),
        once; None when none ran since."""
        clock, self.measuring.done_clock = self.measuring.done_clock, None
        return clock

    def unit_device_bytes(self, name: str) -> int:
        return self.memory.unit_bytes(name)

    @property
    def holds_weights(self) -> bool:
        """The module's tensors point at the executor's device copies between forwards."""
        return self.binding.held is not None

    def restore_weights(self) -> None:
        """Point every tensor back at its master now (device buffers stay for the next forward)."""
        if self._running:
            raise RuntimeError("cannot restore the weights while a forward runs")
        self.binding.drop_held()

    # -- the schedule of one forward (walked by ``walk``) ------------------------------------

    def _begin(self, plan: Plan) -> None:
        self.memory.free_for(plan, self._stale_copies, self.transfers.order_after_copies)
        self.masters.tiers.use(plan.tiers)  # under a RAM budget: units leave RAM before others enter
        self.transfers.load_resident(plan, self._stale_copies)
        self._stale_copies = False
        self.walk.begin(plan, self._loaded)

    def _enter(self, name: str, module: nn.Module | None = None) -> None:
        if not self._running:
            return  # hooks held between forwards: someone else is running these modules
        if not self.measuring.switch(self._current, name, module):
            return
        self._current = name
        self.walk.enter(name, self._holding, self._loaded)
        self.measuring.entered(name)

    def _loaded(self, name: str, dc: DeviceCopy) -> None:
        """Run ``on_loaded`` once per device copy, when the copy is usable by compute."""
        if self.on_loaded is None or dc.patched:
            return
        dc.patched = True
        # not paused for the meter: what the hook allocates (a merge's temporaries) is device
        # memory the unit really uses
        with self.memory.alloc_context():
            self.on_loaded(self._unit(name))

    # -- held weights: an all-resident plan between forwards ---------------------------------

    def _after_forward(self, plan: Plan, ok: bool) -> None:
        """Point tensors back at their masters, or keep an all-resident plan swapped in for the
        next forward of the session (only where nothing is measured and nothing streams)."""
        if ok and self.measuring.meas is not None:
            self.hooks.learn(self.measuring.order)
        if ok and self.binding.held is plan:
            return
        self.binding.drop_held()  # a held plan's forward failed
        if (ok and self.measuring.meter is None and not self._stale_copies and plan.slots == 0
                and (self._in_session or (self.keep_buffers and self.hold_weights))
                and not plan.streamed_order and all(n in self.memory.resident for n in self.binding.swapped)):
            self.hooks.remove()  # nothing streams: no unit needs entering
            self.binding.hold(plan, self._module() if self._module is not None else None, self._foreign_forward)
            return
        self.binding.restore_all()

    def _foreign_forward(self) -> None:
        if not self._running:
            self.binding.drop_held()  # a forward that is not ours reads the masters

    # -- measurement and stats ---------------------------------------------------------------

    def _check_live(self, live: int | None = None) -> None:
        self.measuring.check_live(self._running, self._current, live)


def call_seconds(device, repeats: int = 5) -> float:
    """The executor's own cost of a call on ``device``: the seconds a forward of a plan with no
    units takes (its host work: the schedule walk's start and end, hooks, bindings, its timing),
    best of ``repeats`` after one to warm up. On CUDA timed by events on the compute stream, left
    idle first (it then waits for the host alone: what the host's work adds to a call that the
    device does not hide); on CPU by the clock."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    ex = SegmentedExecutor(lambda name: None, dev)
    plan = Plan(1, (), (), 0, 0, True)
    best = float("inf")
    try:
        for i in range(repeats + 1):
            if cuda:
                stream = torch.cuda.current_stream(dev)
                stream.synchronize()  # (no hazard: the probe owns no buffer) an idle stream times the host
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                ex.forward(plan, lambda: None)
                b.record(stream)
                b.synchronize()
                t = a.elapsed_time(b) / 1e3
            else:
                t0 = time.perf_counter()
                ex.forward(plan, lambda: None)
                t = time.perf_counter() - t0
            if i:
                best = min(best, t)
    finally:
        ex.release()
    return max(best, 0.0)

