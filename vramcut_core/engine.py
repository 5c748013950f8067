"""The engine: one module under one budget.

``Engine.run(fn, *args, **kwargs)`` runs a forward of the module segmented. Before the first
forward for an input signature, a dry run on fake tensors (``trace``) gives each unit's
activation bytes; the merged plan is built from them, so a budget too small for the shape is
refused at once, before any weight is copied, with the smallest budget that works. The first real
forward runs that plan and measures: its figures are the authority, and the plan cached for the
signature is rebuilt from them. Later forwards with the same signature reuse it, so a sampling run
plans once; a new resolution or batch plans again.

On CUDA, shapes that alternate while the executor holds
its buffers (CFG's cond and uncond, two batch sizes) and whose plans would lay the buffers out
differently share one plan, made from the most each unit needed in any of them: a steady step of
any mix of them then reshapes nothing (no buffer freed or allocated, no host sync, no
``empty_cache``, no fragmentation of the allocator's cache).

The one rule: the first forward stays within the budget too. Where the dry run cannot run (or its
plan is passed), the first forward is the measured one of old: every unit streams through one
slot, cut only as far as the budget needs for weights alone; the executor stops it the moment
weights plus live activations would pass the budget, and the engine cuts every unit of the
slot's size finer and measures again, for as long as that lowers the weights it holds. When it
cannot, a ``BudgetError`` names what does not fit and a lower bound of the budget that works.

With ``VRAMCUT_VERIFY=1`` in the environment (or ``EngineConfig(verify=True)``) the first forward
of each new shape is run a second time unpatched on the same inputs and the largest absolute
difference is logged and kept in ``Engine.verify_results``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import torch
from torch import nn

from .executor import SegmentedExecutor
from .measure import OverBudget, UnitMeasurement, describe_signature, joint_measurements, signature
from .plan import STOPPED, BudgetError, Plan, PlanOptions, budget_error
from .report import RunStats, plan_to_json, plan_to_text
from .tensors import fmt_bytes, max_abs_diff
from .trace import MEASURED, TRACED, TraceResult, trace_units, tracing
from .planner import UnitPlanner

log = logging.getLogger("vramcut")

VERIFY_ENV = "VRAMCUT_VERIFY"


def verify_from_env() -> bool:
    return os.environ.get(VERIFY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    budget_bytes: int
    device: str = "cuda"
    family: str | None = None
    prefetch: bool = True
    residency: bool = True
    pinned: tuple[str, ...] = ()     # unit name patterns that must stay resident
    track_cpu_memory: bool = False   # measure activations on every CPU forward, not only the first
    pin_memory: bool = True          # page-lock host masters (CUDA); off: plain pageable copies
    keep_file_backed: bool = False   # file-mapped weights stay their own masters (no flat host
                                     # copy), streamed through a page-locked window (a fast disk)
    verify: bool = dataclasses.field(default_factory=verify_from_env)  # compare first forwards with unpatched

    def __post_init__(self) -> None:
        if not isinstance(self.budget_bytes, int) or isinstance(self.budget_bytes, bool) or self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {self.budget_bytes!r}")

    @property
    def options(self) -> PlanOptions:
        return PlanOptions(prefetch=self.prefetch, residency=self.residency)


class TraceUnavailable(RuntimeError):
    """The dry run could not run these inputs (``Engine.preview_as``); the message says why."""


class Engine:
    def __init__(self, module: nn.Module, config: EngineConfig,
                 on_plan: Callable[["Engine", Plan, tuple], None] | None = None) -> None:
        self.module = module
        self.on_plan = on_plan
        self.planner = UnitPlanner(module, config)
        self.executor = SegmentedExecutor(self.planner.unit, config.device, pin_memory=config.pin_memory,
                                          track_cpu_memory=config.track_cpu_memory, module=module,
                                          keep_file_backed=config.keep_file_backed)
        self.planner.unit_bytes = self.executor.unit_device_bytes
        self.planner.block_bytes = self.executor.memory.block_bytes
        self._plans: dict[tuple, Plan] = {}
        self._joined: dict[tuple, frozenset] = {}   # signature -> the signatures sharing its plan
        self._failed: dict[tuple, BudgetError] = {}
        self.measurements: dict[tuple, dict[str, UnitMeasurement]] = {}
        self.traces: dict[tuple, TraceResult] = {}  # the dry run's profile per input signature
        self._replanned: dict[tuple, str] = {}  # signatures a steady forward's peak sent back to measuring: why
        self.last_plan: Plan | None = None
        self.last_signature: tuple | None = None
        self.stats = RunStats()
        self.last_stats: RunStats | None = None
        self.steady_stats = RunStats()  # the forwards that ran a plan (not the measuring ones)
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
        return self.planner.weight_plan(options)

    def revalidate(self) -> None:
        """Find the units again if the module's tensors were replaced from outside (a host that
        sets new Parameter objects); plans stay cached when the unit names did not change.
        Skipped while the executor holds the weights of an all-resident plan between forwards:
        whoever replaces or writes weights inside a session calls ``weights_changed`` first."""
        if self.executor.holds_weights or not self.planner.stale():
            return
        self.executor.forget_units()
        if self.planner.refind():
            self._plans.clear()
            self._joined.clear()
            self._failed.clear()
            self.measurements.clear()
            self.traces.clear()

    # -- the first forward of a signature ----------------------------------------------------

    def _measure(self, fn: Callable, args: tuple, kwargs: dict, cap: int | None = None):
        """The measured forward, within the budget: (output, stats, measurements by whole unit).
        Units larger than ``cap`` are cut finer first; stopped before passing the budget, it is run
        again with the slot cut finer."""
        budget = self.config.budget_bytes
        cap = budget if cap is None else max(1, cap)
        last: int | None = None
        while True:
            base = self.planner.measuring_plan(cap)
            try:
                out, stats, meas = self.executor.forward(base, fn, *args, measure=True,
                                                         limit_bytes=budget, **kwargs)
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

    def _first_forward(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict):
        """The first forward of a signature: (output, stats, measurements by whole unit, source).
        Planned from the dry run when it ran (a budget too small is refused here, nothing copied).
        On CPU the real forward runs that plan and measures (the dry run counts what the CPU meter
        counts). On CUDA the caching allocator holds more than the operators' bytes (rounding,
        blocks it does not reuse: what the CUDA meter counts), so the first forward is the
        measuring one, its slot cut up front to fit beside the traced activations. Either way it
        stops before passing the budget, and is measured the old way if it does."""
        tr = self._trace(sig, fn, args, kwargs)
        if tr.reason is not None:
            log.warning("VRAMCut: the dry run could not run (%s); the first forward measures the "
                        "activations instead (a budget too small is found only as it runs)", tr.reason)
        if tr.measurements is None:
            return (*self._measure(fn, args, kwargs), MEASURED)
        plan = self.planner.measured_plan(dict(tr.measurements), TRACED)  # refuses a budget too small
        if self.executor.cuda:
            pinned = self.planner.pinned_bytes()
            return (*self._measure(fn, args, kwargs, self.config.budget_bytes - pinned - tr.peak_bytes), TRACED)
        try:
            out, stats, meas = self.executor.forward(plan, fn, *args, measure=True,
                                                     limit_bytes=self.config.budget_bytes, **kwargs)
            return out, stats, self.planner.aggregate(meas), TRACED
        except OverBudget as e:
            log.warning("VRAMCut: the first forward passed the traced plan in '%s' (%s weights + %s "
                        "activations); measuring it again", e.unit, fmt_bytes(e.weight_bytes),
                        fmt_bytes(e.activation_bytes))
        return (*self._measure(fn, args, kwargs), TRACED)

    def _trace(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict, keep_failure: bool = True) -> TraceResult:
        """The dry run's profile of ``sig``, cached (a failure only with ``keep_failure``)."""
        tr = self.traces.get(sig)
        if tr is None:
            self.executor.restore_weights()  # the dry run swaps the registries the held copies use
            tr = trace_units(self.module, self.unitset.units, fn, args, kwargs)
            if tr.measurements is not None or keep_failure:
                self.traces[sig] = tr
        return tr

    def preview_as(self, sig: tuple, fn: Callable, *args, **kwargs) -> Plan:
        """The plan the first forward of ``fn(*args, **kwargs)`` (input signature ``sig``) would
        run, from the dry run alone: no weight copied, no real forward. A budget too small is a
        ``BudgetError``, a forward the dry run cannot run a ``TraceUnavailable``; neither is
        remembered. Only the traced profile stays, cached as the first forward would cache it."""
        self.revalidate()
        tr = self._trace(sig, fn, args, kwargs, keep_failure=False)
        if tr.measurements is None:
            raise TraceUnavailable(tr.reason or "the dry run gave no figures")
        return self.planner.measured_plan(dict(tr.measurements), TRACED)

    def plan_for(self, args: tuple = (), kwargs: dict | None = None) -> Plan | None:
        return self._plans.get(signature(args, kwargs or {}))

    # -- running ---------------------------------------------------------------------------

    def session(self):
        """Keep device buffers between forwards (a sampling run); release them at the end."""
        return self.executor.session()

    def release(self) -> None:
        self.executor.release()

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget (resolved late, from the device's free memory): plans and failures made
        for the old one are dropped; measurements stay."""
        if budget_bytes != self.config.budget_bytes:
            self.config = dataclasses.replace(self.config, budget_bytes=budget_bytes)
            self._plans.clear()
            self._joined.clear()
            self._failed.clear()

    def keep_buffers(self, keep: bool) -> None:
        """Hold device buffers between forwards (a host that ends runs with a callback)."""
        self.executor.keep_buffers = keep
        if not keep and not self.executor.running:
            self.executor.release()

    def hold_weights(self, hold: bool) -> None:
        """With buffers kept between forwards (``keep_buffers``), also keep an all-resident plan's
        weights swapped in between forwards, so a forward runs no hooks and no pointer swaps
        (a session always does). Turned off, the module points at its masters again."""
        self.executor.hold_weights = hold
        if not hold and not self.executor.running:
            self.executor.restore_weights()

    def weights_changed(self) -> None:
        """The host wrote into the module's weights in place (hook LoRAs between forwards):
        device copies held between forwards are copied again before the next forward reads them."""
        self.executor.invalidate()

    def order_streams(self, streams: Callable[[], list] | None) -> None:
        """``streams()`` lists the other streams that may read weights while they are swapped in
        (a host's offload streams); each is ordered after the copies, as the compute stream is."""
        self.executor.reader_streams = streams

    def activation_need(self, args: tuple = (), kwargs: dict | None = None) -> int | None:
        """Measured activation bytes of a forward with these inputs (None before it has run):
        what a host should count for the call, the weights being the engine's own business."""
        plan = self.plan_for(args, kwargs)
        return None if plan is None else plan.activation_reserve_bytes

    @property
    def held_bytes(self) -> int:
        """Device bytes the engine holds now (weights kept between forwards)."""
        return self.executor.device_bytes

    def run(self, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)``, a forward of the module, segmented under the budget."""
        return self.run_as(signature(args, kwargs), fn, *args, **kwargs)

    def run_as(self, sig: tuple, fn: Callable, *args, **kwargs):
        """``run`` with the input signature given (for calls whose inputs are not tensors yet,
        such as a text encoder's token lists)."""
        if tracing():  # reached from inside a dry run: its tensors are fakes, nothing to plan
            return fn(*args, **kwargs)
        self.revalidate()
        failed = self._failed.get(sig)
        if failed is not None:
            raise failed
        plan = self._plans.get(sig)
        if plan is None:
            try:
                out, stats, meas, source = self._guard(lambda f, a, k: self._first_forward(sig, f, a, k),
                                                       fn, args, kwargs)
                meas = self.measurements[sig] = _grown(self.measurements.get(sig), meas)
                plan = self.planner.measured_plan(meas, source)
                why = self._replanned.get(sig)
                if why:  # the node shows why this shape was planned again (the new plan only)
                    plan = dataclasses.replace(plan, warnings=plan.warnings + (f"planned again: {why}",))
                    self._replanned[sig] = ""
            except BudgetError as e:
                self._failed[sig] = e  # the same input will not fit next time either
                raise
            if self.config.verify:
                self.verify_results.append(verify_unpatched(sig, out, fn, args, kwargs))
            self._plans[sig] = plan
            self._record(plan, sig, stats)
            if self.on_plan is not None:
                self.on_plan(self, plan, sig)
            return out
        plan = self._steady(sig, plan)
        out, stats, _ = self._guard(lambda f, a, k: self.executor.forward(plan, f, *a, **k), fn, args, kwargs)
        self._record(plan, sig, stats)
        self.steady_stats.add(stats)
        if stats.peak_device_bytes > self.config.budget_bytes and sig not in self._replanned:
            # the host or the input behaved differently from the measured forward (a temporary
            # inside a block grew): measure the next forward again and plan from the larger
            # figures, once (a plan must stay stable)
            why = (f"forward {self.stats.forwards} ({describe_signature(sig)}) peaked at "
                   f"{fmt_bytes(stats.peak_device_bytes)}, above the budget {fmt_bytes(self.config.budget_bytes)}")
            self._replanned[sig] = why
            del self._plans[sig]
            self.traces.pop(sig, None)  # the dry run runs the host's code again too
            log.warning("VRAMCut: %s; the next one measures again and plans once more", why)
        return out
        return out

    def _steady(self, sig: tuple, plan: Plan) -> Plan:
        """The plan to run ``sig`` with: its own, or, when it alternates with the last shape while
        buffers are held and the two plans lay them out differently, one plan for both (see the
        module docstring)."""
        last, prev = self.last_plan, self.last_signature
        if (not self.executor.cuda or last is None or last is plan or not self.executor.device_bytes
                or self._plans.get(prev) is not last or _buffers(last) == _buffers(plan)):
            return plan
        group = self._joined.get(sig, frozenset((sig,))) | self._joined.get(prev, frozenset((prev,)))
        meas = joint_measurements([self.measurements[s] for s in group if s in self.measurements])
        if meas is None:
            return plan
        try:
            joint = self.planner.measured_plan(meas, plan.source)
        except BudgetError:
            return plan
        for s in group:
            self._plans[s], self._joined[s] = joint, group
        if self.on_plan is not None:
            self.on_plan(self, joint, sig)
        return joint

    def _guard(self, run: Callable, fn: Callable, args: tuple, kwargs: dict):
        """``run(fn, args, kwargs)``; a real out-of-memory error inside it comes out naming the
        segment that ran and the bytes the executor held (it has released them by then)."""
        try:
            return run(fn, args, kwargs)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(_oom_message(self.executor, self.config.budget_bytes, e)) from e

    def reset_stats(self) -> None:
        self.stats = RunStats()
        self.steady_stats = RunStats()

    def _record(self, plan: Plan, sig: tuple, stats: RunStats) -> None:
        self.last_plan, self.last_signature, self.last_stats = plan, sig, stats
        self.stats.add(stats)

    # -- report ----------------------------------------------------------------------------

    def describe(self, plan: Plan | None = None) -> dict:
        plan = plan or self.last_plan or self.weight_plan()
        sig = self.last_signature if plan is self.last_plan else None
        return {
            "family": self.unitset.family,
            "label": self.unitset.label,
            "stage": "measured" if plan.measured else "weights",
            "source": plan.source,
            "trace_reason": (self.traces[sig].reason if sig in self.traces else None) if sig else None,
            "signature": describe_signature(sig) if sig else None,
            "warnings": list(plan.warnings),
            "text": plan_to_text(plan, stats=self.stats if plan.measured else None,
                                 steady=self.steady_stats if plan.measured else None) + "".join(
                f"\nverify {r['signature']}: " + (f"could not run the unpatched forward ({r['error']})" if r["error"]
                                                  else f"max |segmented - unpatched| = {r['max_abs_diff']:g}")
                for r in self.verify_results),
            "plan": plan_to_json(plan, self.stats if plan.measured else None,
                                 self.steady_stats if plan.measured else None),
            "verify": list(self.verify_results),
        }


def _stopped_error(base: Plan, e: OverBudget, budget: int, unit_bytes: Callable[[str], int]) -> BudgetError:
    """A measuring forward stopped: what it saw is a lower bound of the budget that works (the
    units after the one it stopped in were never run)."""
    held = base.resident_bytes + (unit_bytes(e.unit) if e.kind == "weights" else base.window_bytes)
    detail = ("this forward runs it and it cannot be cut finer" if e.kind == "weights" else
              "cut as fine as they go; the forward was stopped there")
    return budget_error(e.unit or "?", budget, kind=e.kind, weight_bytes=held,
                        activation_bytes=e.activation_bytes, min_budget_bytes=held + e.activation_bytes,
                        exact=False, detail=detail, bound=STOPPED)


def _oom_message(ex: SegmentedExecutor, budget: int, e: Exception) -> str:
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


def _grown(old: dict[str, UnitMeasurement] | None, new: dict[str, UnitMeasurement]) -> dict[str, UnitMeasurement]:
    """A re-measured signature keeps the larger figure of each unit (the peak that sent it back)."""
    for n, m in (old or {}).items():
        if n in new:
            new[n] = UnitMeasurement(max(m.entry_bytes, new[n].entry_bytes), max(m.peak_bytes, new[n].peak_bytes),
                                     max(m.calls, new[n].calls), m.modules | new[n].modules)
    return new


def _segment_of(plan: Plan, unit: str) -> str | None:
    for seg in plan.segments:
        if any(plan.units[i].name == unit for i in seg.units):
            return plan.segment_name(seg)
    return None

def verify_unpatched(sig: tuple, out, fn: Callable, args: tuple, kwargs: dict) -> dict:
    """Run ``fn`` unpatched on the same inputs; the largest |difference| from ``out``, logged."""
    res = {"signature": describe_signature(sig), "max_abs_diff": None, "equal": None, "error": None}
    try:
        ref = fn(*args, **kwargs)
        res["max_abs_diff"], res["equal"] = max_abs_diff(out, ref)
    except Exception as e:  # verification must never break the run it checks
        res["error"] = f"{type(e).__name__}: {e}"
    if res["error"]:
        log.warning("VRAMCut verify (%s): the unpatched forward could not run: %s", res["signature"], res["error"])
    else:
        log.warning("VRAMCut verify (%s): max |segmented - unpatched| = %g (%s)", res["signature"],
                    res["max_abs_diff"], "bit-equal" if res["equal"] else "differs")
    return res



__all__ = ["Engine", "EngineConfig", "BudgetError", "TraceUnavailable"]
