"""The engine: one module under one budget, on one device or several.

``Engine.run(fn, *args, **kwargs)`` runs a forward of the module segmented. What the engine knows
of each input signature is one ``shape.Shape`` in a table (``Engine.shapes``), and every forward
walks that shape's life, the same for any number of devices:

* NEW/TRACED -> MEASURING -> PLANNED: before the first forward of a signature, a dry run on fake
  tensors (``trace``) gives each unit's activation bytes; the plan built from them refuses a
  budget too small for the shape at once, before any weight is copied, with the smallest budget
  that works (REFUSED: the same input fails so until the budgets change). The first real forward
  runs within the budget and measures: its figures are the authority, and the shape is planned
  from them.
* PLANNED/STEADY: later forwards with the same signature run that plan, so a sampling run plans
  once; a new resolution or batch is a new shape.
* measure again, once: a steady forward whose measured peak passed a budget (the host or the
  input behaved differently from the measured forward) sends the shape back to measuring; the
  next forward measures again and plans from the larger figures, once in a shape's life (a plan
  must stay stable).
* re-fit: new budgets (``set_budget``; ``set_devices``: free memory read again before a call) keep
  every plan while each device's part still holds its peak and no budget grew past
  ``plan.REFIT_MARGIN`` (``plan.refit_reason``: no churn when free memory wobbles); else every
  planned shape is planned again at its next forward from its measurements (none measures again),
  a fallen budget planned ``plan.REFIT_DOWN_MARGIN`` below it, and the plan says why
  (``Plan.refit``).

What differs between one device and several sits behind one interface, the device side
(``one_device.OneDevice``; ``devices.SeveralDevices``: a group of executors, the hops between
devices, a peak per device): the measuring first forward, a forward of the plan, a plan made
again from the measurements, the dry run's plan, the plan's JSON. One device is a placement of
one.

With ``VRAMCUT_VERIFY=1`` (or ``EngineConfig(verify=True)``) a shape's measuring forward is run
again unpatched and the largest absolute difference is logged and kept (``verify_results``).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch
from torch import nn

from .config import EngineConfig, HostHooks, TraceUnavailable
from .devices import SeveralDevices
from .figures.meters import describe_signature, signature, verify_unpatched
from .figures.trace import TraceResult, trace_units, tracing
from .model.tensors import fmt_bytes
from .one_device import OneDevice, oom_message
from .planning.placement import Placement, in_devices_form, refit_reasons
from .planning.budget import BudgetError
from .planning.plan import Plan, PlanOptions, Refit, refit_budget
from .planning.planner import UnitPlanner
from .planning.report import RunStats, plan_to_json, plan_to_text
from .runtime.executor import SegmentedExecutor, call_seconds
from .shape import AGAIN, NEW, PLANNED, REFUSED, STEADY, TO_PLACE, TRACED, Shape, Shapes

log = logging.getLogger("vramcut")


class Engine:
    """The engine's public face, and the adapter's only door: a host builds one per module with
    its ``HostHooks`` and runs forwards through ``run`` / ``run_as``."""

    def __init__(self, module: nn.Module, config: EngineConfig,
                 on_plan: Callable[["Engine", Plan, tuple], None] | None = None,
                 host: HostHooks | None = None) -> None:
        self.module = module
        self.on_plan = on_plan
        host = host or HostHooks()
        self.planner = UnitPlanner(module, config, lambda name: self.executor.unit_device_bytes(name))
        self.planner.figures.room = lambda: self.probe_room_bytes  # probes run inside the budget

        def make(device):
            return SegmentedExecutor(self.planner.unit, device, pin_memory=config.pin_memory,
                                     track_cpu_memory=config.track_cpu_memory, module=module,
                                     keep_file_backed=config.keep_file_backed,
                                     alloc_context=host.alloc_context, reader_streams=host.reader_streams,
                                     page_lock_room=host.page_lock_room)

        # more than one device: one executor per device (the home one answers for the engine)
        self.side = (SeveralDevices(make, self.planner, config) if len(config.devices) > 1
                     else OneDevice(make(config.device), self.planner))
        self.executor = self.side.executor
        self.executors = self.side.executors
        self.group = self.side.group
        self.planner.block_bytes = self.executor.memory.block_bytes
        self.planner.host = self.executor.masters.tiers
        self.planner.figures.call_probe = call_seconds  # the executor's own cost of a call
        self.shapes = Shapes(self.planner.top)
        self.last_plan: Plan | None = None
        self.last_signature: tuple | None = None
        self.last_stats: RunStats | None = None
        self.stats, self.steady_stats = RunStats(), RunStats()  # steady: the forwards that ran a plan
        self.verify_results: list[dict] = []

    # -- units (the planner owns them) ------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.planner.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self.planner.config = config

    @property
    def unitset(self):
        return self.planner.unitset

    def weight_plan(self, options: PlanOptions | None = None) -> Plan:
        """The plan from weights alone (structural order, activations not measured)."""
        try:
            return self.planner.weight_plan(options)
        except BudgetError as e:
            raise in_devices_form(e, self.config.devices) from None

    def revalidate(self) -> None:
        """Find the units again if the module's tensors were replaced from outside (a host that
        sets new Parameter objects); plans stay cached when the unit names did not change.
        Skipped while the executor holds the weights of an all-resident plan between forwards:
        whoever replaces or writes weights inside a session calls ``weights_changed`` first."""
        if any(ex.holds_weights for ex in self.executors) or not self.planner.stale():
            return
        for ex in self.executors:
            ex.forget_units()
        if self.planner.refind():
            for s in self.shapes.values():
                s.forget()

    # -- what the engine knows per shape (read-only views of ``shapes``) ---------------------

    measurements = property(lambda self: self.shapes.measurements())
    traces = property(lambda self: self.shapes.traces())
    # per device, the forwards that ran a placement (several devices; empty on one)
    device_stats = property(lambda self: self.side.device_stats)
    last_device_stats = property(lambda self: self.side.last_device_stats)

    def plan_for(self, args: tuple = (), kwargs: dict | None = None) -> Plan | None:
        s = self._shape(signature(args, kwargs or {}))
        return s.plan if s is not None else None

    def _shape(self, sig: tuple | None) -> Shape | None:
        return self.shapes.get(sig) if sig is not None else None

    # -- a shape's life ----------------------------------------------------------------------

    def run(self, fn: Callable, *args, on_loaded: Callable | None = None, **kwargs):
        """Run ``fn(*args, **kwargs)``, a forward of the module, segmented under the budget.

        ``on_loaded(unit)``, for this forward, is called once a fresh device copy of a unit's
        weights is usable by compute, before any of its modules runs: a host merges weight
        patches (LoRA) into the device copy there."""
        return self.run_as(signature(args, kwargs), fn, *args, on_loaded=on_loaded, **kwargs)

    def run_as(self, sig: tuple, fn: Callable, *args, on_loaded: Callable | None = None, **kwargs):
        """``run`` with the input signature given (for calls whose inputs are not tensors yet,
        such as a text encoder's token lists)."""
        if tracing():  # reached from inside a dry run: its tensors are fakes, nothing to plan
            return fn(*args, **kwargs)
        with self.side.loading(on_loaded):
            return self._run(sig, fn, args, kwargs)

    def _run(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict):
        self.revalidate()
        s = self.shapes.of(sig)
        if s.state == REFUSED:
            raise s.failure
        if s.state in (NEW, TRACED, AGAIN):
            return self._first(s, fn, args, kwargs)
        placed = s.state == TO_PLACE
        if placed:   # planned again for new budgets, from the measurements
            try:
                self.side.place(s, fn, args, kwargs)
            except BudgetError as e:
                raise self._refuse(s, e) from None
        last = self._shape(self.last_signature)
        last = last if last is not None and last.plan is not None and last.plan is self.last_plan else None
        out, stats, over = self._guard(lambda f, a, k: self.side.steady(s, last, self.shapes, self._notify, f, a, k),
                                       fn, args, kwargs)
        s.ran()
        self._record(s.plan, sig, stats)
        self.steady_stats.add(stats)
        if placed:
            self._notify(s.plan, sig)
        if over:
            self._over(s, over)
        return out

    def _first(self, s: Shape, fn: Callable, args: tuple, kwargs: dict):
        """The measuring forward of a shape (its first, or the one measure-again)."""
        tr = self._trace(s, fn, args, kwargs)
        s.measuring()
        try:
            out, stats = self._guard(lambda f, a, k: self.side.first(s, tr, f, a, k), fn, args, kwargs)
        except BudgetError as e:
            raise self._refuse(s, e) from None
        except BaseException:
            s.abort()
            raise
        if self.config.verify:
            self.verify_results.append(verify_unpatched(s.sig, out, fn, args, kwargs))
        self._record(s.plan, s.sig, stats)
        self._notify(s.plan, s.sig)
        return out

    def _refuse(self, s: Shape, e: BudgetError) -> BudgetError:
        """Refuse ``s`` (the same input will not fit next time either); with devices the error
        names each device's own smallest budget (``placement.in_devices_form``)."""
        s.refuse(e := in_devices_form(e, self.config.devices))
        return e

    def _over(self, s: Shape, over: list[tuple[str, int, int]]) -> None:
        """A steady forward passed a device's budget: measure the next forward again and plan
        from the larger figures, once (``Shape.measure_again``)."""
        one = len(over) == 1 and self.group is None
        why = f"forward {self.stats.forwards} ({describe_signature(s.sig)})" + (" " if one else ": ") + ", ".join(
            f"{'' if one else d + ' '}peaked at {fmt_bytes(p)}, above {'the' if one else 'its'} budget {fmt_bytes(b)}"
            for d, p, b in over)
        if s.measure_again(why):
            log.warning("VRAMCut: %s; the next forward measures again and plans once more", why)

    def _trace(self, s: Shape, fn: Callable, args: tuple, kwargs: dict, keep_failure: bool = True,
               on_loaded: Callable | None = None) -> TraceResult:
        """The dry run's profile of shape ``s``, kept (a failure only with ``keep_failure``). The
        call's ``on_loaded`` hook (the executor's, in a run) runs in it, on the fakes."""
        if s.trace is not None:
            return s.trace
        for ex in self.executors:
            ex.restore_weights()  # the dry run swaps the registries the held copies use
        tr = trace_units(self.module, self.unitset.units, fn, args, kwargs,
                         on_loaded=on_loaded or self.executor.on_loaded)
        if tr.measurements is not None or keep_failure:
            s.traced(tr)
        return tr

    def preview_as(self, sig: tuple, fn: Callable, *args, on_loaded: Callable | None = None, **kwargs) -> Plan:
        """The plan the first forward of ``fn(*args, **kwargs)`` (input signature ``sig``) would
        run, from the dry run alone: no weight copied, no real forward. A budget too small is a
        ``BudgetError``, a forward the dry run cannot run a ``TraceUnavailable``; neither is
        remembered. Only the traced profile stays, kept as the first forward would keep it
        (``on_loaded``: the hook the run will call, as ``run`` takes it)."""
        self.revalidate()
        s = self.shapes.get(sig) or Shape(sig, self.planner.top)
        tr = self._trace(s, fn, args, kwargs, keep_failure=False, on_loaded=on_loaded)
        if tr.measurements is None:
            raise TraceUnavailable(tr.reason or "the dry run gave no figures")
        self.shapes.setdefault(sig, s)
        try:
            return self.side.preview(dict(tr.measurements))
        except BudgetError as e:
            raise in_devices_form(e, self.config.devices) from None

    def _notify(self, plan: Plan, sig: tuple) -> None:
        if plan is not None and sig == self.last_signature:
            self.last_plan = plan
        if self.on_plan is not None and plan is not None:
            self.on_plan(self, plan, sig)

    def _guard(self, run: Callable, fn: Callable, args: tuple, kwargs: dict):
        """``run(fn, args, kwargs)``; a real out-of-memory error inside it comes out naming the
        segment that ran and the bytes the executor held (it has released them by then)."""
        try:
            return run(fn, args, kwargs)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(oom_message(self.executor, self.config.budget_bytes, e)) from e

    def reset_stats(self) -> None:
        self.stats, self.steady_stats = RunStats(), RunStats()

    def _record(self, plan: Plan, sig: tuple, stats: RunStats) -> None:
        self.last_plan, self.last_signature, self.last_stats = plan, sig, stats
        self.stats.add(stats)

    # -- budgets -----------------------------------------------------------------------------

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget for the one device (free memory read again before a step): a re-fit."""
        if budget_bytes != self.config.budget_bytes:
            self._refit(((str(self.executor.device), budget_bytes),))

    def set_devices(self, devices: Sequence[tuple[str, int]]) -> None:
        """New budgets for the same devices (a ``free`` entry read again before a call): a re-fit
        (see the module docstring). Budgets too small for a measured shape refuse it then."""
        devices, old = tuple((str(torch.device(d)), int(b)) for d, b in devices), self.config.devices
        if devices == old:
            return
        if [d for d, _ in devices] != [d for d, _ in old]:
            raise ValueError(f"set_devices: new budgets for the same devices ({', '.join(d for d, _ in old)}), "
                             f"in the same order; got {', '.join(d for d, _ in devices)}")
        self._refit(devices)

    def _refit(self, devices: tuple[tuple[str, int], ...]) -> None:
        """The one re-fit for one device or several (see the module docstring)."""
        total = sum(b for _, b in devices)
        self.config = dataclasses.replace(self.config, budget_bytes=total,
                                          devices=devices if self.config.devices else ())
        for s in self.shapes.in_state(REFUSED):
            s.reopen()   # refused for the old budgets
        last = self._shape(self.last_signature)
        placed = self.side.placement(last) if last is not None and last.planned else None
        whys = refit_reasons(placed, dict(devices)) if placed is not None else None
        if whys == []:
            self.side.keep(devices)   # every device's part still holds
            return
        for s in self.shapes.in_state(PLANNED, STEADY):
            if s.measurements is not None:
                s.to_place()
            else:
                s.forget_plan()
        if placed is None:
            self.side.fit(None)
            return   # nothing planned yet
        why = "; ".join(whys)
        log.warning("VRAMCut: %s; planning again", why)
        if not self.running:
            self.release()   # the old plan's buffers go before the new plan allocates
        before = {d.device: d.budget_bytes for d in placed.devices}
        self.side.fit(tuple((d, refit_budget(b, before.get(d, b))) for d, b in devices))
        self.side.refit = Refit(why, total, sum(before.values()))

    # -- the executors, one per device (``one_device.DeviceSide`` says what each does) -------
    def session(self):
        return self.side.session()

    def release(self) -> None:
        self.side.release()

    def wait_copies(self) -> None:
        self.side.wait_copies()

    def keep_buffers(self, keep: bool) -> None:
        self.side.keep_buffers(keep)

    def hold_weights(self, hold: bool) -> None:
        self.side.hold_weights(hold)

    def weights_changed(self) -> None:
        self.side.weights_changed()

    running = property(lambda self: self.side.running)   # a forward of this engine runs now
    rest = property(lambda self: self.side.rest)   # rest(): between runs, the module whole, the buffers kept
    device = property(lambda self: self.executor.device)   # the home device: inputs and output
    held_bytes = property(lambda self: sum(self.side.held_bytes_by_device.values()))  # held now, all devices
    held_bytes_by_device = property(lambda self: self.side.held_bytes_by_device)
    # device bytes a probe (``bandwidth``: a copy, a matrix product) may take now on the home device
    probe_room_bytes = property(lambda self: max(0, dict(self.config.devices).get(
        self.config.device, self.config.budget_bytes) - self.executor.device_bytes))

    @property
    def placement(self) -> Placement | None:
        """The placement the last forward ran (None on one device)."""
        s = self._shape(self.last_signature)
        return s.placed[0] if s is not None and s.placed is not None else None

    # -- report ----------------------------------------------------------------------------

    def describe(self, plan: Plan | None = None) -> dict:
        """The plan (the last forward's by default) as the host shows it: text and JSON."""
        return _describe(self, plan or self.last_plan or self.weight_plan())


def _describe(eng: Engine, plan: Plan) -> dict:
    sig = eng.last_signature if plan is eng.last_plan else None
    s = eng._shape(sig)
    stats, steady = (eng.stats, eng.steady_stats) if plan.measured else (None, None)
    return {
        "family": eng.unitset.family,
        "label": eng.unitset.label,
        "stage": "measured" if plan.measured else "weights",
        "source": plan.source,
        "trace_reason": s.trace.reason if s is not None and s.trace is not None else None,
        "signature": describe_signature(sig) if sig else None,
        "warnings": list(plan.warnings),
        "text": plan_to_text(plan, stats=stats, steady=steady) + "".join(
            f"\nverify {r['signature']}: " + (f"could not run the unpatched forward ({r['error']})" if r["error"]
                                              else f"max |segmented - unpatched| = {r['max_abs_diff']:g}")
            for r in eng.verify_results),
        "plan": eng.side.plan_json(s, plan_to_json(plan, stats, steady)),
        "verify": list(eng.verify_results),
    }


__all__ = ["Engine", "EngineConfig", "HostHooks", "BudgetError", "TraceUnavailable"]
