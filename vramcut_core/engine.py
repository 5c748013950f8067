"""The engine: one module under one budget.

``Engine.run(fn, *args, **kwargs)`` runs a forward of the module segmented. The first forward
for an input signature is the measured one: every unit streams through one slot while the
activation meter records each unit's live bytes; from that, the merged plan for the signature is
built and cached. Later forwards with the same signature reuse it, so a sampling run plans once;
a new resolution or batch plans again.

The one rule: the measured forward stays within the budget too. It starts with the units cut
only as far as the budget needs for weights alone (cutting adds resident parts, so it is not done
for nothing); the executor stops it the moment weights plus live activations would pass the
budget, and the engine then cuts every unit of the slot's size finer and measures again, for as
long as that lowers the weights it holds. When it cannot, a ``BudgetError`` names what does not
fit and the smallest budget that works.

With ``VRAMCUT_VERIFY=1`` in the environment (or ``EngineConfig(verify=True)``) the first forward
of each new shape is run a second time unpatched on the same inputs and the largest absolute
difference is logged and kept in ``Engine.verify_results``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
from typing import Callable

import torch
from torch import nn

from . import quant
from .executor import SegmentedExecutor
from .measure import OverBudget, UnitMeasurement, describe_signature, signature
from .plan import BudgetError, Plan, PlanOptions, PlanUnit, budget_error, gib_text, make_plan, measuring_plan
from .report import RunStats, plan_to_json, plan_to_text
from .tensors import fmt_bytes, is_plain_tensor
from .units import Unit, find_units, split_unit

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
    verify: bool = dataclasses.field(default_factory=verify_from_env)  # compare first forwards with unpatched

    def __post_init__(self) -> None:
        if not isinstance(self.budget_bytes, int) or isinstance(self.budget_bytes, bool) or self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {self.budget_bytes!r}")

    @property
    def options(self) -> PlanOptions:
        return PlanOptions(prefetch=self.prefetch, residency=self.residency)


class Engine:
    def __init__(self, module: nn.Module, config: EngineConfig,
                 on_plan: Callable[["Engine", Plan, tuple], None] | None = None) -> None:
        self.module = module
        self.config = config
        self.on_plan = on_plan
        self.unitset = find_units(module, config.family)
        self._all: dict[str, Unit] = {}
        self._reset_units()
        self.executor = SegmentedExecutor(self._lookup, config.device, pin_memory=config.pin_memory,
                                          track_cpu_memory=config.track_cpu_memory, module=module)
        self._plans: dict[tuple, Plan] = {}
        self._failed: dict[tuple, BudgetError] = {}
        self.measurements: dict[tuple, dict[str, UnitMeasurement]] = {}
        self.last_plan: Plan | None = None
        self.last_signature: tuple | None = None
        self.stats = RunStats()
        self.last_stats: RunStats | None = None
        self.steady_stats = RunStats()  # the forwards that ran a plan (not the measuring ones)
        self.verify_results: list[dict] = []

    # -- units -----------------------------------------------------------------------------

    def _reset_units(self) -> None:
        self._all = {u.name: u for u in self.unitset.units}
        self._checks: list | None = None
        self._parent: dict[str, str] = {}  # a part of a finer cut -> the unit it was cut from
        for u in self.unitset.units:
            if any(fnmatch.fnmatchcase(u.name, p) for p in self.config.pinned):
                u.pinned = True
        fmts = sorted({quant.format_name(t.tensor) for u in self.unitset.units for t in u.tensors
                       if not is_plain_tensor(t.tensor) and quant.parts(t.tensor) is None})
        if fmts:
            self.unitset.warnings.append(
                f"weights in {', '.join(fmts)} cannot be taken apart: they are moved one by one "
                "beside the streaming slots (still counted in the budget)")

    def _lookup(self, name: str) -> Unit:
        return self._all[name]

    def _stale(self) -> bool:
        checks = self._checks
        if checks is None:  # (registry, key, tensor) of each unit tensor, flat: checked every forward
            checks = self._checks = [(r.owner._parameters if r.is_param else r.owner._buffers, r.key, t.tensor)
                                     for u in self.unitset.units for t in u.tensors for r in t.refs[:1]]
        for store, key, t in checks:
            if store.get(key) is not t:
                return True
        return False

    def revalidate(self) -> None:
        """Find the units again if the module's tensors were replaced from outside (a host that
        sets new Parameter objects); plans stay cached when the unit names did not change.
        Skipped while the executor holds the weights of an all-resident plan between forwards:
        whoever replaces or writes weights inside a session calls ``weights_changed`` first."""
        if self.executor.holds_weights or not self._stale():
            return
        old = [u.name for u in self.unitset.units]
        self.executor.forget_units()
        self.unitset = find_units(self.module, self.config.family)
        self._reset_units()
        if [u.name for u in self.unitset.units] != old:
            self._plans.clear()
            self._failed.clear()
            self.measurements.clear()

    def _split(self, name: str, meas: dict[str, UnitMeasurement] | None) -> list[PlanUnit] | None:
        parts = split_unit(self._all[name])
        if not parts:
            return None
        parent = meas.get(name) if meas else None
        for p in parts:
            self._all[p.name] = p
            self._parent.setdefault(p.name, name)
            if meas is None or parent is None:
                continue
            # A part needs at most what the whole unit needed, and it ran only if one of its
            # modules did (a VAE decode runs one convolution of a unit that holds the encoder).
            if p.pinned or not parent.modules or any(id(m) in parent.modules for m in _subtree(p)):
                meas[p.name] = parent
        return [self._plan_unit(p, meas) for p in parts]

    def _plan_unit(self, u: Unit, meas: dict[str, UnitMeasurement] | None, pin: bool = False) -> PlanUnit:
        m = meas.get(u.name) if meas is not None else None
        return PlanUnit(u.name, self.executor.unit_device_bytes(u.name),
                        None if meas is None else (m.peak_bytes if m else 0),
                        None if meas is None else (m.entry_bytes if m else 0),
                        u.pinned or pin, entered=meas is None or m is not None or u.kind == "shared",
                        calls=m.calls if m else 1)

    # -- plans -----------------------------------------------------------------------------

    def weight_plan(self, options: PlanOptions | None = None) -> Plan:
        """The plan from weights alone (structural order, activations not measured)."""
        units = [self._plan_unit(u, None) for u in self.unitset.units]
        return make_plan(units, self.config.budget_bytes, options or self.config.options,
                         lambda n: self._split(n, None), self.unitset.warnings)

    def _measuring_plan(self, cap: int) -> Plan:
        """The plan of the measured forward: one slot, nothing resident but what must be, every
        unit larger than ``cap`` bytes cut finer where it can be. The slot is sized over the units
        that can fit at all (a unit too large is only a problem if the forward enters it)."""
        budget = self.config.budget_bytes
        todo = [self._plan_unit(u, None) for u in reversed(self.unitset.units)]
        units: list[PlanUnit] = []
        split: list[str] = []
        while todo:
            u = todo.pop()
            if not u.pinned and u.weight_bytes > cap:
                parts = self._split(u.name, None)
                if parts:
                    split.append(u.name)
                    todo.extend(reversed(parts))
                    continue
            units.append(u)
        pinned = sum(u.weight_bytes for u in units if u.pinned)
        if pinned > budget:
            raise budget_error(units, None, budget, "it must stay resident")
        slot = max((u.weight_bytes for u in units if not u.pinned and u.weight_bytes <= budget - pinned),
                   default=0)
        return measuring_plan(units, budget, slot, split, self.unitset.warnings)

    def _top(self, name: str) -> str:
        while name in self._parent:
            name = self._parent[name]
        return name

    def _aggregate(self, meas: dict[str, UnitMeasurement]) -> dict[str, UnitMeasurement]:
        """Measurements of the parts of a finer cut, as the units they were cut from (in the
        order the forward entered them): the plan starts from whole units and cuts again only
        where the budget needs it."""
        out: dict[str, UnitMeasurement] = {}
        for n, m in meas.items():
            t = self._top(n)
            a = out.get(t)
            if a is None:
                out[t] = UnitMeasurement(m.entry_bytes, m.peak_bytes, m.calls, m.modules)
            else:
                a.peak_bytes = max(a.peak_bytes, m.peak_bytes)
                a.calls = max(a.calls, m.calls)
                a.modules = a.modules | m.modules
        return out

    def _measure(self, fn: Callable, args: tuple, kwargs: dict):
        """The measured forward, within the budget: (output, stats, measurements by whole unit).
        Stopped before passing the budget, it is run again with the slot cut finer."""
        budget = self.config.budget_bytes
        cap = budget
        last: int | None = None
        while True:
            base = self._measuring_plan(cap)
            try:
                out, stats, meas = self.executor.forward(base, fn, *args, measure=True,
                                                         limit_bytes=budget, **kwargs)
                return out, stats, self._aggregate(meas)
            except OverBudget as e:
                if e.kind == "weights":
                    raise self._weights_error(base, e) from None
                held = base.resident_bytes + base.window_bytes
                hopeless = base.resident_bytes + e.activation_bytes > budget  # no slot would help
                if base.slot_bytes == 0 or hopeless or (last is not None and held >= last):
                    raise self._activations_error(base, e) from None
                log.info("VRAMCut: measuring forward stopped before passing the budget in '%s' "
                         "(%s weights + %s activations); cutting the slot finer", e.unit,
                         fmt_bytes(e.weight_bytes), fmt_bytes(e.activation_bytes))
                last, cap = held, base.slot_bytes - 1  # cut every unit of the slot's size

    def _weights_error(self, base: Plan, e: OverBudget) -> BudgetError:
        budget = self.config.budget_bytes
        w = self.executor.unit_device_bytes(e.unit)
        need = base.resident_bytes + w + e.activation_bytes
        msg = (f"VRAM budget {fmt_bytes(budget)} is too small: unit '{e.unit}' needs {fmt_bytes(w)} of "
               f"weights on the device, and this forward runs it (cannot be cut finer); the smallest "
               f"max_vram_gb that works for this shape is at least {gib_text(need)}")
        err = BudgetError(e.unit, need, budget, kind="weights", message=msg)
        err.min_budget_bytes = need  # a lower bound: the forward stopped at this unit
        return err

    def _activations_error(self, base: Plan, e: OverBudget) -> BudgetError:
        budget = self.config.budget_bytes
        w = base.resident_bytes + base.window_bytes
        msg = (f"VRAM budget {fmt_bytes(budget)} is too small for this input shape: its activations "
               f"passed {fmt_bytes(e.activation_bytes)} in unit '{e.unit}' beside {fmt_bytes(w)} of weights "
               f"(cut as fine as they go), and the forward was stopped there")
        msg += f"; the smallest max_vram_gb that works for this shape is at least {gib_text(w + e.activation_bytes)}"
        err = BudgetError(e.unit or "?", w + e.activation_bytes, budget, kind="activations", message=msg)
        err.min_budget_bytes = w + e.activation_bytes  # a lower bound: the forward did not finish
        return err

    def _measured_plan(self, meas: dict[str, UnitMeasurement]) -> Plan:
        names = [u.name for u in self.unitset.units]
        entered = [n for n in meas if n in self._all]
        order = entered + [n for n in names if n not in meas]
        split = lambda n: self._split(n, meas)  # noqa: E731
        looped = {n for n in entered if meas[n].calls > 1}
        if looped and self.config.residency:
            # A forward that loops over its units (a video VAE decoding frame by frame) would
            # re-send streamed weights on every pass: keep the looped units resident if they fit.
            units = [self._plan_unit(self._all[n], meas, pin=n in looped) for n in order]
            try:
                return make_plan(units, self.config.budget_bytes, self.config.options, split,
                                 self.unitset.warnings)
            except BudgetError:
                pass
        units = [self._plan_unit(self._all[n], meas) for n in order]
        notes = list(self.unitset.warnings)
        if looped:
            worst = max(meas[n].calls for n in looped)
            notes.append(f"the forward enters {len(looped)} units up to {worst} times; what streams is "
                         f"copied on every pass (a larger budget keeps them resident)")
        return make_plan(units, self.config.budget_bytes, self.config.options, split, notes)

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
        self.revalidate()
        failed = self._failed.get(sig)
        if failed is not None:
            raise failed
        plan = self._plans.get(sig)
        if plan is None:
            try:
                out, stats, meas = self._guard(self._measure, fn, args, kwargs)
                self.measurements[sig] = meas
                plan = self._measured_plan(meas)
            except BudgetError as e:
                self._failed[sig] = e  # the same input will not fit next time either
                raise
            if self.config.verify:
                self._verify(sig, out, fn, args, kwargs)
            self._plans[sig] = plan
            self._record(plan, sig, stats)
            if self.on_plan is not None:
                self.on_plan(self, plan, sig)
            return out
        out, stats, _ = self._guard(lambda f, a, k: self.executor.forward(plan, f, *a, **k), fn, args, kwargs)
        self._record(plan, sig, stats)
        self.steady_stats.add(stats)
        return out

    def _guard(self, run: Callable, fn: Callable, args: tuple, kwargs: dict):
        """``run(fn, args, kwargs)``; a real out-of-memory error inside it comes out naming the
        segment that ran and the bytes the executor held (it has released them by then)."""
        try:
            return run(fn, args, kwargs)
        except torch.OutOfMemoryError as e:
            ex = self.executor
            unit = ex.failed_unit
            where = "before any unit ran" if ex.failed_tracked else "in a resident segment"
            if unit is not None:
                seg = _segment_of(ex.failed_plan, unit) if ex.failed_plan is not None else None
                where = f"in segment '{seg or unit}'"
                if not ex.failed_tracked:  # resident units are not hooked outside measuring
                    where += " or a resident segment after it"
            msg = (f"VRAMCut: out of memory {where}, with {fmt_bytes(ex.failed_device_bytes)} of weights on "
                   f"the device under a budget of {fmt_bytes(self.config.budget_bytes)} (all released; the "
                   f"model is unchanged): {e}")
            raise torch.OutOfMemoryError(msg) from e

    def _verify(self, sig: tuple, out, fn: Callable, args: tuple, kwargs: dict) -> None:
        """Run ``fn`` unpatched on the same inputs and record the largest |difference|."""
        res = {"signature": describe_signature(sig), "max_abs_diff": None, "equal": None, "error": None}
        try:
            ref = fn(*args, **kwargs)
            res["max_abs_diff"], res["equal"] = _max_abs_diff(out, ref)
        except Exception as e:  # verification must never break the run it checks
            res["error"] = f"{type(e).__name__}: {e}"
        self.verify_results.append(res)
        if res["error"]:
            log.warning("VRAMCut verify (%s): the unpatched forward could not run: %s", res["signature"], res["error"])
        else:
            log.warning("VRAMCut verify (%s): max |segmented - unpatched| = %g (%s)", res["signature"],
                        res["max_abs_diff"], "bit-equal" if res["equal"] else "differs")

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


def _subtree(u: Unit) -> list[nn.Module]:
    """Every module of a unit (its roots' submodules and the owners of its tensors)."""
    mods = list(u.hook_modules)
    for _, m in u.roots:
        mods.extend(m.modules())
    return mods


def _segment_of(plan: Plan, unit: str) -> str | None:
    for seg in plan.segments:
        if any(plan.units[i].name == unit for i in seg.units):
            return plan.segment_name(seg)
    return None


def _max_abs_diff(out, ref) -> tuple[float, bool]:
    """Largest |out - ref| over the tensors of two outputs of the same structure."""
    from torch.utils._pytree import tree_flatten

    a, _ = tree_flatten(out)
    b, _ = tree_flatten(ref)
    ta = [x for x in a if isinstance(x, torch.Tensor)]
    tb = [x for x in b if isinstance(x, torch.Tensor)]
    if len(ta) != len(tb):
        return float("inf"), False
    worst, equal = 0.0, True
    for x, y in zip(ta, tb):
        if x.shape != y.shape:
            return float("inf"), False
        equal = equal and torch.equal(x, y.to(x.device))
        if x.numel():
            d = (x.double() - y.to(x.device).double()).abs().max().item()
            worst = max(worst, d if d == d else float("inf"))
    return worst, equal


__all__ = ["Engine", "EngineConfig", "BudgetError"]
