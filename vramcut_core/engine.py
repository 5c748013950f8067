"""The engine: one module under one budget.

``Engine.run(fn, *args, **kwargs)`` runs a forward of the module segmented. The first forward
for an input signature is the measured one: every unit streams through one slot (the smallest
footprint there is) while the activation meter records each unit's live bytes; from that, the
merged plan for the signature is built and cached. Later forwards with the same signature reuse
it, so a sampling run plans once; a new resolution or batch plans again.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Callable

from torch import nn

from . import quant
from .executor import SegmentedExecutor
from .measure import UnitMeasurement, describe_signature, signature
from .plan import BudgetError, Plan, PlanOptions, PlanUnit, make_plan
from .report import RunStats, plan_to_json, plan_to_text
from .tensors import is_plain_tensor
from .units import Unit, find_units, split_unit


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

    # -- units -----------------------------------------------------------------------------

    def _reset_units(self) -> None:
        self._all = {u.name: u for u in self.unitset.units}
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
        for u in self.unitset.units:
            for t in u.tensors:
                if t.refs[0].get() is not t.tensor:
                    return True
        return False

    def revalidate(self) -> None:
        """Find the units again if the module's tensors were replaced from outside (a host that
        sets new Parameter objects); plans stay cached when the unit names did not change."""
        if not self._stale():
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
            if meas is None or parent is None:
                continue
            # A part needs at most what the whole unit needed, and it ran only if one of its
            # modules did (a VAE decode runs one convolution of a unit that holds the encoder).
            if p.pinned or not parent.modules or any(id(m) in parent.modules for m in p.hook_modules):
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

    def _measuring_plan(self) -> Plan:
        """The smallest footprint there is, for the measured forward: one slot, nothing resident
        but what must be."""
        return self.weight_plan(PlanOptions(prefetch=False, residency=False))

    def _measured_plan(self, base: Plan, meas: dict[str, UnitMeasurement]) -> Plan:
        names = [u.name for u in base.units]
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

    def keep_buffers(self, keep: bool) -> None:
        """Hold device buffers between forwards (a host that ends runs with a callback)."""
        self.executor.keep_buffers = keep
        if not keep and not self.executor.running:
            self.executor.release()

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
            base = self._measuring_plan()
            out, stats, meas = self.executor.forward(base, fn, *args, measure=True, **kwargs)
            self.measurements[sig] = meas
            try:
                plan = self._measured_plan(base, meas)
            except BudgetError as e:
                self._failed[sig] = e  # the same input will not fit next time either
                raise
            self._plans[sig] = plan
            self._record(plan, sig, stats)
            if self.on_plan is not None:
                self.on_plan(self, plan, sig)
            return out
        out, stats, _ = self.executor.forward(plan, fn, *args, **kwargs)
        self._record(plan, sig, stats)
        return out

    def reset_stats(self) -> None:
        self.stats = RunStats()

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
            "text": plan_to_text(plan, stats=self.stats if plan.measured else None),
            "plan": plan_to_json(plan, self.stats if plan.measured else None),
        }


__all__ = ["Engine", "EngineConfig", "BudgetError"]
