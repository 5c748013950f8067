"""One device: the engine's device side for a module on one device (``devices.SeveralDevices``
is the other).

A device side answers the engine's lifecycle (``shape``) with what differs between one device and
several: the measuring first forward (``first``), a forward of the plan (``steady``), a plan made
again from the measurements for new budgets (``place``), the plan a dry run gives (``preview``),
the placement its budgets are judged by (``placement``: one device is a placement of one) and the
plan's JSON extras. The engine keeps the states, the rules and the records.

On one device the first forward is measured within the budget: planned from the dry run when it
ran (a budget too small is refused before any weight is copied); on CPU the real forward runs that
plan and measures (the dry run counts what the CPU meter counts); on CUDA the caching allocator
holds more than the operators' bytes (rounding, blocks it does not reuse: what the CUDA meter
counts), so the first forward is the measuring one, its slot cut up front to fit beside the
traced activations. Where the dry run cannot run, every unit streams through one slot, cut only
as far as the budget needs for weights alone; stopped the moment weights plus live activations
would pass the budget, every unit of the slot's size is cut finer and it measures again, for as
long as that lowers the weights it holds; when it cannot, a ``BudgetError`` names what does not
fit and a lower bound of the budget that works.

On CUDA, shapes that alternate while the executor holds its buffers (CFG's cond and uncond, two
batch sizes) and whose plans would lay the buffers out differently share one plan (``_joint``),
made from the most each unit needed in any of them: a steady step of any mix of them then
reshapes nothing (no buffer freed or allocated, no host sync, no ``empty_cache``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable

from .figures import speed
from .figures.meters import OverBudget, joint_measurements
from .figures.trace import MEASURED, TRACED
from .model.tensors import fmt_bytes
from .planning.placement import DevicePlan, Placement
from .planning.budget import STOPPED, BudgetError, budget_error
from .planning.plan import Plan

log = logging.getLogger("vramcut")


class DeviceSide:
    """What both device sides do to their executors (``executors``, the home one ``executor``)."""

    executors: list

    def session(self):
        """Keep device buffers between forwards (a sampling run); release them at the end."""
        if len(self.executors) == 1:
            return self.executors[0].session()
        stack = contextlib.ExitStack()
        for ex in self.executors:
            stack.enter_context(ex.session())
        return stack

    def release(self) -> None:
        for ex in self.executors:
            ex.release()

    @contextlib.contextmanager
    def loading(self, on_loaded):
        """``on_loaded`` called by every executor for one forward (``Engine.run``)."""
        outers = [ex.on_loaded for ex in self.executors]
        for ex in self.executors:
            ex.on_loaded = on_loaded
        try:
            yield
        finally:
            for ex, outer in zip(self.executors, outers):
                ex.on_loaded = outer

    def wait_copies(self) -> None:
        """Block the host until every copy the engine has issued has landed, on every device:
        for a host about to unpin (unregister) host memory those copies may read. A host sync,
        for teardown only."""
        for ex in self.executors:
            ex.transfers.wait_copies()  # hazard: host memory unregistered while a copy reads it

    def keep_buffers(self, keep: bool) -> None:
        for ex in self.executors:
            ex.keep_buffers = keep
            if not keep and not ex.running:
                ex.release()

    def hold_weights(self, hold: bool) -> None:
        """With buffers kept between forwards (``keep_buffers``), also keep an all-resident plan's
        weights swapped in between forwards, so a forward runs no hooks and no pointer swaps
        (a session always does). Turned off, the module points at its masters again."""
        for ex in self.executors:
            ex.hold_weights = hold
            if not hold and not ex.running:
                ex.restore_weights()

    def rest(self) -> None:
        """The end of a run: the module whole again, the buffers kept (``SegmentedExecutor.rest``)."""
        for ex in self.executors:
            ex.hold_weights = False
            if not ex.running:
                ex.rest()

    def weights_changed(self) -> None:
        """The host wrote into the module's weights in place (hook LoRAs between forwards):
        device copies held between forwards are copied again before the next forward reads them."""
        for ex in self.executors:
            ex.invalidate()

    @property
    def running(self) -> bool:
        return any(ex.running for ex in self.executors)

    @property
    def held_bytes_by_device(self) -> dict[str, int]:
        """Device bytes the engine holds now (weights kept between forwards), per device."""
        return {str(ex.device): ex.device_bytes for ex in self.executors}


class OneDevice(DeviceSide):
    def __init__(self, executor, planner) -> None:
        self.executor = executor
        self.executors = [executor]
        self.planner = planner
        self.group = None
        self.device_stats: dict = {}        # per device: only several devices keep these
        self.last_device_stats: dict = {}
        self.refit = None   # plan.Refit: why the plans were made again for new budgets (the engine's)

    def fit(self, low: tuple[tuple[str, int], ...] | None) -> None:
        """Plans are made for ``low``'s budget where it is below the config's and they fit
        (a fallen budget, planned a margin below it: ``plan.refit_budget``)."""
        b = low[0][1] if low else None
        self.planner.plan_budget = b if b is not None and b < self.planner.config.budget_bytes else None

    def keep(self, devices) -> None:
        """New budgets that every part still holds: plans stay made for no more than either says."""
        if self.planner.plan_budget is not None:
            self.planner.plan_budget = min(self.planner.plan_budget, devices[0][1])

    def placement(self, shape) -> Placement | None:
        p = shape.plan
        if p is None:
            return None
        return Placement(p.units, (DevicePlan(str(self.executor.device), p.budget_bytes, 0, len(p.units), p),), ())

    # -- the lifecycle's forwards ------------------------------------------------------------

    def first(self, shape, tr, fn: Callable, args: tuple, kwargs: dict):
        """The measuring first forward of ``shape`` (dry run ``tr``), planned from what it saw:
        (output, stats); ``shape`` ends PLANNED."""
        out, stats, meas, source = self._first_forward(tr, fn, args, kwargs)
        meas = shape.measured(meas)
        clock = self.executor.take_clock()
        if self.executor.cuda:
            shape.times.measured(clock)
        else:  # the CPU meter's Python at every operator is in that clock: time the next forward
            shape.untimed = True
        plan = self.planner.measured_plan(meas, source, shape.times.seconds())
        shape.planned_as(self._said(plan, shape))
        return out, stats

    def place(self, shape, fn: Callable, args: tuple, kwargs: dict) -> None:
        """``shape``'s plan made again from its measurements for new budgets (TO_PLACE -> PLANNED)."""
        source = shape.trace.source if shape.trace is not None else MEASURED
        plan = self.planner.measured_plan(shape.measurements, source, shape.times.seconds())
        shape.planned_as(self._said(plan, shape))

    def steady(self, shape, last, shapes, notify: Callable, fn: Callable, args: tuple, kwargs: dict):
        """A forward of ``shape``'s plan (timed again or shared with the ``last`` shape first):
        (output, stats, [(device, peak, budget)] of a device that passed its budget)."""
        ex = self.executor
        if shape.times.ready():
            self._retime(shape, notify)
        plan = self._joint(shape, last, shapes, notify)
        timing = shape.untimed
        out, stats, _ = ex.forward(plan, fn, *args, clock=timing, **kwargs)
        if timing:
            shape.untimed = False
            shape.times.measured(ex.take_clock())
            if speed.by_time(self.planner.config):
                self._retime(shape, notify)
        budget = self.planner.config.budget_bytes
        over = [(str(ex.device), stats.peak_device_bytes, budget)] if stats.peak_device_bytes > budget else []
        return out, stats, over

    def preview(self, meas) -> Plan:
        return self.planner.measured_plan(meas, TRACED)

    def plan_json(self, shape, out: dict) -> dict:
        load = self.executor.masters.tiers.load_json() if isinstance(out.get("tiers"), dict) else None
        if load is not None:  # under a RAM budget, once the tiers were applied: measured
            out["tiers"]["load"] = load
        return out

    # -- inside ------------------------------------------------------------------------------

    def _said(self, plan: Plan, shape) -> Plan:
        """``plan`` saying why its shape was measured again, and the re-fit it was made for."""
        if shape.again_warnings:
            plan = dataclasses.replace(plan, warnings=plan.warnings + shape.again_warnings)
        return dataclasses.replace(plan, refit=self.refit) if self.refit is not None else plan

    def _retime(self, shape, notify: Callable) -> None:
        """The plan made again from the unit times just measured (measured compute times replace
        the dry run's estimate)."""
        plan, secs = shape.plan, shape.times.seconds()
        if secs is None or shape.measurements is None:
            return
        new = self.planner.measured_plan(shape.measurements, plan.source, secs)
        again = tuple(w for w in plan.warnings if w.startswith("planned again") and w not in new.warnings)
        new = dataclasses.replace(new, warnings=new.warnings + again, refit=plan.refit)
        shape.replanned(new)
        notify(new, shape.sig)

    def _joint(self, shape, last, shapes, notify: Callable) -> Plan:
        """The plan to run ``shape`` with: its own, or, when it alternates with the ``last`` shape
        while buffers are held and the two plans lay them out differently, one plan for both."""
        plan = shape.plan
        if (not self.executor.cuda or last is None or last is shape or last.plan is None or last.plan is plan
                or not self.executor.device_bytes or _buffers(last.plan) == _buffers(plan)):
            return plan
        group = shape.joined | last.joined
        meas = joint_measurements([shapes[s].measurements for s in group
                                   if s in shapes and shapes[s].measurements is not None])
        if meas is None:
            return plan
        try:
            joint = self.planner.measured_plan(meas, plan.source, shape.times.seconds())
        except BudgetError:
            return plan
        for s in group:
            if s in shapes and shapes[s].planned:
                shapes[s].replanned(joint, group)
        notify(joint, shape.sig)
        return joint

    def _first_forward(self, tr, fn: Callable, args: tuple, kwargs: dict):
        """(output, stats, measurements by whole unit, source); see the module docstring."""
        ex, planner = self.executor, self.planner
        if tr.reason is not None:
            log.warning("VRAMCut: the dry run could not run (%s); the first forward measures the "
                        "activations instead (a budget too small is found only as it runs)", tr.reason)
        if tr.measurements is None:
            return (*self._measure(fn, args, kwargs), MEASURED)
        plan = planner.measured_plan(dict(tr.measurements), TRACED)  # refuses a budget too small
        budget = planner.config.budget_bytes
        if ex.cuda:
            return (*self._measure(fn, args, kwargs, budget - planner.keep_resident_bytes() - tr.peak_bytes), TRACED)
        try:
            out, stats, meas = ex.forward(plan, fn, *args, measure=True, limit_bytes=budget, **kwargs)
            return out, stats, planner.aggregate(meas), TRACED
        except OverBudget as e:
            log.warning("VRAMCut: the first forward passed the traced plan in '%s' (%s weights + %s "
                        "activations); measuring it again", e.unit, fmt_bytes(e.weight_bytes),
                        fmt_bytes(e.activation_bytes))
        return (*self._measure(fn, args, kwargs), TRACED)

    def _measure(self, fn: Callable, args: tuple, kwargs: dict, cap: int | None = None):
        """The measured forward, within the budget: (output, stats, measurements by whole unit).
        Units larger than ``cap`` are cut finer first; stopped before passing the budget, it is run
        again with the slot cut finer."""
        budget = self.planner.config.budget_bytes
        cap = budget if cap is None else max(1, cap)
        last: int | None = None
        while True:
            base = self.planner.measuring_plan(cap)
            try:
                out, stats, meas = self.executor.forward(base, fn, *args, measure=True, limit_bytes=budget, **kwargs)
                return out, stats, self.planner.aggregate(meas)
            except OverBudget as e:
                held = base.resident_bytes + base.window_bytes
                hopeless = base.resident_bytes + e.activation_bytes > budget  # no slot would help
                if (e.kind == "weights" or base.slot_bytes == 0 or hopeless
                        or (last is not None and held >= last)):
                    raise _stopped_error(base, e, budget, self.executor.unit_device_bytes) from None
                log.info("VRAMCut: measuring forward stopped before passing the budget in '%s' "
                         "(%s weights + %s activations); cutting the slot finer", e.unit,
                         fmt_bytes(e.weight_bytes), fmt_bytes(e.activation_bytes))
                last, cap = held, base.slot_bytes - 1  # cut every unit of the slot's size


def _stopped_error(base: Plan, e: OverBudget, budget: int, unit_bytes: Callable[[str], int]) -> BudgetError:
    """A measuring forward stopped: what it saw is a lower bound of the budget that works (the
    units after the one it stopped in were never run)."""
    held = base.resident_bytes + (unit_bytes(e.unit) if e.kind == "weights" else base.window_bytes)
    detail = ("this forward runs it and it cannot be cut finer" if e.kind == "weights" else
              "cut as fine as they go; the forward was stopped there")
    return budget_error(e.unit or "?", budget, kind=e.kind, weight_bytes=held,
                        activation_bytes=e.activation_bytes, min_budget_bytes=held + e.activation_bytes,
                        exact=False, detail=detail, bound=STOPPED)


def oom_message(ex, budget: int, e: Exception) -> str:
    """A real out-of-memory error, naming the segment that ran and the bytes the executor held
    (it has released them by then)."""
    unit = ex.failed_unit
    where = "before any unit ran" if ex.failed_tracked else "in a resident segment"
    if unit is not None:
        seg = _segment_of(ex.failed_plan, unit) if ex.failed_plan is not None else None
        where = f"in segment '{seg or unit}'"
        if not ex.failed_tracked:  # resident units are not hooked outside measuring
            where += " or a resident segment after it"
    return (f"VRAMCut: out of memory {where}, with {fmt_bytes(ex.failed_device_bytes)} of weights on "
            f"the device under a budget of {fmt_bytes(budget)} (all released; the model is unchanged): {e}")


def _buffers(plan: Plan) -> tuple:
    """What the executor allocates for a plan: resident units, slots and their size."""
    return frozenset(plan.resident_units), plan.slots, plan.slot_bytes


def _segment_of(plan: Plan, unit: str) -> str | None:
    for seg in plan.segments:
        if any(plan.units[i].name == unit for i in seg.units):
            return plan.segment_name(seg)
    return None
