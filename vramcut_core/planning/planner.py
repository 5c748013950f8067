"""Units and the plans made from them: what the engine cuts, and how a plan is built.

``UnitPlanner`` owns a module's units (found by ``units.find_units``, plus the parts of every
finer cut made since, with the unit each part was cut from) and turns weights, measurements or a
dry run's figures into a ``Plan`` through the pure functions of ``plan``. It may call ``units``,
``plan`` and ``quant``; it never runs a forward and never touches device memory (the bytes a unit
takes on the device come from ``unit_bytes``, the executor's layout).

Where the config chooses residency by time (``speed``), a measured plan's units carry their
compute seconds (``PlanUnit.compute_s``: measured per unit where a forward was timed, else the dry
run's FLOPs over the measured throughput), the residency is ``residency.by_time``'s and the plan
carries its predicted step (``Plan.time``, ``timeline.predict``) and the bound on any residency's
(``bound.lower_bound``). Under a RAM budget a timed plan's residency and host tiers are chosen
together (``joint.fastest``: the residency sees the reads of its units streamed from disk). The throughput probe and the
bandwidth figure come through ``speed.Figures`` (``bandwidth``'s cached measurements).

The one rule: a plan is a function of the units, the figures and the config it is given; the
planner keeps no per-signature state (the engine caches plans).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Callable

from torch import nn

from ..model import quant
from . import joint, residency, tiers, timeline
from .bound import lower_bound
from ..figures import speed
from ..figures.meters import UnitMeasurement
from .budget import BudgetError, budget_error
from .plan import Plan, PlanOptions, PlanTime, PlanUnit, make_plan, measuring_plan
from ..model.tensors import is_plain_tensor
from ..model.units import Unit, UnitSet, find_units, split_unit


class UnitPlanner:
    def __init__(self, module: nn.Module, config, unit_bytes: Callable[[str], int]) -> None:
        self.module = module
        self.config = config          # the engine's EngineConfig (replaced when the budget changes)
        self.unit_bytes = unit_bytes  # unit name -> bytes it takes on the device (the executor's layout)
        self.block_bytes = 1          # the device allocator's block size (set by the engine)
        # plans are made for this many bytes where it is below the config's budget and they fit
        # (set by ``Engine.set_budget`` after a fall: hysteresis, see ``plan.refit_budget``)
        self.plan_budget: int | None = None
        self.unitset: UnitSet = find_units(module, config.family)
        self.figures = speed.Figures(module)
        self.host = None              # the executor's ``HostTiers`` (host bytes of a unit, the disk's rate)
        self.all: dict[str, Unit] = {}
        self.parent: dict[str, str] = {}
        self._reset()

    # -- units -----------------------------------------------------------------------------

    def _reset(self) -> None:
        self.all = {u.name: u for u in self.unitset.units}
        self._checks: list | None = None
        self.parent = {}  # a part of a finer cut -> the unit it was cut from
        for u in self.unitset.units:
            if any(fnmatch.fnmatchcase(u.name, p) for p in self.config.keep_resident):
                u.keep_resident = True
        fmts = sorted({quant.format_name(t.tensor) for u in self.unitset.units for t in u.tensors
                       if not is_plain_tensor(t.tensor) and quant.parts(t.tensor) is None})
        if fmts:
            self.unitset.warnings.append(
                f"weights in {', '.join(fmts)} cannot be taken apart: they are moved one by one "
                "beside the streaming slots (still counted in the budget)")

    @property
    def options(self) -> PlanOptions:
        """The config's plan options, with the device allocator's block size."""
        return dataclasses.replace(self.config.options, block_bytes=self.block_bytes)

    def unit(self, name: str) -> Unit:
        return self.all[name]

    def stale(self) -> bool:
        """Were the module's unit tensors replaced from outside since the units were found?"""
        checks = self._checks
        if checks is None:  # (registry, key, tensor) of each unit tensor, flat: checked every forward
            checks = self._checks = [(r.owner._parameters if r.is_param else r.owner._buffers, r.key, t.tensor)
                                     for u in self.unitset.units for t in u.tensors for r in t.refs[:1]]
        for store, key, t in checks:
            if store.get(key) is not t:
                return True
        return False

    def refind(self) -> bool:
        """Find the units again; True when their names changed (cached plans no longer apply)."""
        old = [u.name for u in self.unitset.units]
        self.unitset = find_units(self.module, self.config.family)
        self._reset()
        return [u.name for u in self.unitset.units] != old

    def split(self, name: str, meas: dict[str, UnitMeasurement] | None,
              seconds: dict[str, float] | None = None) -> list[PlanUnit] | None:
        parts = split_unit(self.all[name])
        if not parts:
            return None
        for p in parts:   # known before anything asks for a part's bytes
            self.all[p.name] = p
            self.parent.setdefault(p.name, name)
        if seconds is not None and name in seconds:
            # the parts share the unit's compute time by their weight bytes (nothing timed them)
            total = sum(self.unit_bytes(p.name) for p in parts) or 1
            for p in parts:
                seconds[p.name] = seconds[name] * self.unit_bytes(p.name) / total
        parent = meas.get(name) if meas else None
        for p in parts:
            if meas is None or parent is None:
                continue
            # A part needs at most what the whole unit needed (with the host's merge at the part's
            # own entry: ``part_peak_bytes``), and it ran only if one of its modules did (a VAE
            # decode runs one convolution of a unit that holds the encoder).
            if p.keep_resident or not parent.modules or any(id(m) in parent.modules for m in _subtree(p)):
                meas[p.name] = parent if parent.part_peak_bytes is None else dataclasses.replace(
                    parent, peak_bytes=max(parent.peak_bytes, parent.part_peak_bytes))
        return [self.plan_unit(p, meas, seconds=seconds) for p in parts]

    def plan_unit(self, u: Unit, meas: dict[str, UnitMeasurement] | None, keep_resident: bool = False,
                  seconds: dict[str, float] | None = None) -> PlanUnit:
        m = meas.get(u.name) if meas is not None else None
        return PlanUnit(u.name, self.unit_bytes(u.name),
                        None if meas is None else (m.peak_bytes if m else 0),
                        None if meas is None else (m.entry_bytes if m else 0),
                        u.keep_resident or keep_resident, entered=meas is None or m is not None or u.kind == "shared",
                        calls=m.calls if m else 1, compute_s=(seconds or {}).get(u.name))

    def keep_resident_bytes(self) -> int:
        """Device bytes of the units that must stay resident."""
        return sum(self.unit_bytes(u.name) for u in self.unitset.units if u.keep_resident)

    # -- plans -----------------------------------------------------------------------------

    def weight_plan(self, options: PlanOptions | None = None) -> Plan:
        """The plan from weights alone (structural order, activations not measured)."""
        units = [self.plan_unit(u, None) for u in self.unitset.units]
        return self.tiered(make_plan(units, self.config.budget_bytes, options or self.options,
                                     lambda n: self.split(n, None), self.unitset.warnings))

    def measuring_plan(self, cap: int) -> Plan:
        """The plan of the measured forward: one slot, nothing resident but what must be, every
        unit larger than ``cap`` bytes cut finer where it can be. The slot is sized over the units
        that can fit at all (a unit too large is only a problem if the forward enters it)."""
        budget = self.config.budget_bytes
        todo = [self.plan_unit(u, None) for u in reversed(self.unitset.units)]
        units: list[PlanUnit] = []
        split: list[str] = []
        while todo:
            u = todo.pop()
            if not u.keep_resident and u.weight_bytes > cap:
                parts = self.split(u.name, None)
                if parts:
                    split.append(u.name)
                    todo.extend(reversed(parts))
                    continue
            units.append(u)
        required = sum(u.weight_bytes for u in units if u.keep_resident)
        if required > budget:
            raise budget_error("units that must stay resident", budget, kind="weights", weight_bytes=required,
                               activation_bytes=None, min_budget_bytes=required, exact=False,
                               detail="it must stay resident")
        slot = max((u.weight_bytes for u in units if not u.keep_resident and u.weight_bytes <= budget - required),
                   default=0)
        return self.tiered(measuring_plan(units, budget, slot, split, self.unitset.warnings))

    def top(self, name: str) -> str:
        while name in self.parent:
            name = self.parent[name]
        return name

    def aggregate(self, meas: dict[str, UnitMeasurement]) -> dict[str, UnitMeasurement]:
        """Measurements of the parts of a finer cut, as the units they were cut from (in the
        order the forward entered them): the plan starts from whole units and cuts again only
        where the budget needs it. A unit's FLOPs are its parts' summed (None when a part's are
        not known: a partial count would make the unit look faster than it is)."""
        out: dict[str, UnitMeasurement] = {}
        for n, m in meas.items():
            t = self.top(n)
            a = out.get(t)
            if a is None:
                out[t] = UnitMeasurement(m.entry_bytes, m.peak_bytes, m.calls, m.modules, m.flops)
            else:
                a.peak_bytes = max(a.peak_bytes, m.peak_bytes)
                a.calls = max(a.calls, m.calls)
                a.modules = a.modules | m.modules
                a.flops = None if a.flops is None or m.flops is None else a.flops + m.flops
        return out

    def compute_seconds(self, meas: dict[str, UnitMeasurement],
                        measured: dict[str, float] | None = None) -> tuple[dict[str, float] | None, str | None]:
        """Each entered unit's compute seconds and where they come from: ``measured`` (a timed
        forward's, by whole unit) where it covers every unit in ``meas``, else the dry run's FLOPs
        over the measured throughput ("flops"); (None, None) where the config does not choose by
        time or a figure is missing."""
        if not speed.by_time(self.config):
            return None, None
        if measured is not None and all(n in measured for n in meas):
            return dict(measured), "measured"
        if not meas or any(m.flops is None for m in meas.values()):
            return None, None
        fps = self.figures.flops_per_s(self.config)
        if not fps:
            return None, None
        return {n: timeline.unit_seconds(m.flops, fps) for n, m in meas.items()}, "flops"

    def measured_plan(self, meas: dict[str, UnitMeasurement], source: str,
                      measured: dict[str, float] | None = None) -> Plan:
        """The plan from per-unit figures (measured, or the dry run's), in the order the forward
        entered the units; timed and chosen by time where the config asks for it (``measured``:
        seconds per unit from a timed forward, see ``compute_seconds``). Made for ``plan_budget``
        where one is set below the config's budget and the plan fits it, else for the config's."""
        low = self.plan_budget
        if low is not None and low < self.config.budget_bytes:
            try:
                return self.tiered(self._measured_plan(meas, source, measured, low))
            except BudgetError:
                pass  # the margin does not fit: the whole budget
        return self.tiered(self._measured_plan(meas, source, measured, self.config.budget_bytes))

    def tiered(self, plan: Plan) -> Plan:
        """``plan`` with each unit's host tier under the config's RAM budget (``tiers.choose``; a
        budget below what one call needs is a ``tiers.RamBudgetError``); unchanged without one."""
        budget = self.config.ram_budget_bytes
        if budget is None or self.host is None:
            return plan
        host = {u.name: self.host.host_unit(u.name) for u in plan.units}
        bounce = self.host.bounce_bytes(host)
        rate = self.host.disk_rate(list(host))
        bps = self.figures.bytes_per_s(self.config)
        if plan.time is None or not rate or not bps:
            return dataclasses.replace(plan, tiers=tiers.choose(plan, host, budget, bounce, rate,
                                                              self._step_of(plan, rate, bounce)))
        # timed: the residency sees the reads of the tiers it gets (``joint``)
        overlap = speed.overlaps(self.config)
        lat = self.figures.latency_s(self.config)
        out = joint.fastest(plan, host, budget, bounce, bps, rate, self.options, overlap, lat,
                            lane=self._step_of(plan, rate, bounce) is not None)
        if (out.resident_units, out.slots, out.slot_bytes) == (plan.resident_units, plan.slots, plan.slot_bytes):
            return dataclasses.replace(plan, tiers=out.tiers)
        return dataclasses.replace(out, source=plan.source, refit=plan.refit,
                                   time=self._time(out, plan.time.source, bps, overlap, lat))

    def _step_of(self, plan: Plan, disk_bytes_per_s: float | None, bounce: int):
        """The predicted step with given units on disk (``tiers.choose``'s ``step_of``) where the
        plan is timed: the executor reads ahead beside compute, on CPU into the slot, on CUDA
        (``speed.overlaps``) through the bounce buffer of ``bounce`` bytes, its copies fed by the
        reader; else None (the choice is by bytes)."""
        bps = self.figures.bytes_per_s(self.config)
        if plan.time is None or not disk_bytes_per_s or not bps:
            return None
        lat, overlap = self.figures.latency_s(self.config), speed.overlaps(self.config)
        piece = bounce // 2 if overlap and bounce else None  # (host_memory.BOUNCE_PIECES)
        return lambda reads: timeline.predict(plan, bps, overlap=overlap, session=True, latency_s=lat, reads=reads,
                                              disk_bytes_per_s=disk_bytes_per_s, piece_bytes=piece).step_s

    def _measured_plan(self, meas: dict[str, UnitMeasurement], source: str,
                       measured: dict[str, float] | None, budget: int) -> Plan:
        seconds, tsource = self.compute_seconds(meas, measured)
        names = [u.name for u in self.unitset.units]
        entered = [n for n in meas if n in self.all]
        order = entered + [n for n in names if n not in meas]
        split = lambda n: self.split(n, meas, seconds)  # noqa: E731
        looped = {n for n in entered if meas[n].calls > 1}
        if looped and self.config.residency:
            # A forward that loops over its units (a video VAE decoding frame by frame) would
            # re-send streamed weights on every pass: keep the looped units resident if they fit.
            units = [self.plan_unit(self.all[n], meas, keep_resident=n in looped, seconds=seconds) for n in order]
            try:
                return self.timed(dataclasses.replace(make_plan(units, budget, self.options,
                                                                 split, self.unitset.warnings), source=source), tsource)
            except BudgetError:
                pass
        units = [self.plan_unit(self.all[n], meas, seconds=seconds) for n in order]
        notes = list(self.unitset.warnings)
        if looped:
            worst = max(meas[n].calls for n in looped)
            notes.append(f"the forward enters {len(looped)} units up to {worst} times; what streams is "
                         f"copied on every pass (a larger budget keeps them resident)")
        return self.timed(dataclasses.replace(make_plan(units, budget, self.options, split, notes),
                                               source=source), tsource)

    def timed(self, plan: Plan, source: str | None) -> Plan:
        """``plan`` with its residency chosen by time and its predicted step, where its units have
        compute times and a bandwidth is known; else ``plan`` unchanged."""
        if source is None or not timeline.known(plan.units):
            return plan
        bps = self.figures.bytes_per_s(self.config)
        if not bps:
            return plan
        overlap = speed.overlaps(self.config)
        lat = self.figures.latency_s(self.config)
        plan = dataclasses.replace(residency.by_time(plan, bps, self.options, overlap=overlap, session=True,
                                                     latency_s=lat), source=plan.source)
        return dataclasses.replace(plan, time=self._time(plan, source, bps, overlap, lat))

    def _time(self, plan: Plan, source: str, bps: float, overlap: bool, lat: float) -> PlanTime:
        """``plan``'s predicted step (no reads; the executor's measured cost of a call in it),
        all-resident step and the bound on any residency's (which the cost of a call, host work
        that can only delay a call, leaves a bound)."""
        predicted = timeline.predict(plan, bps, overlap=overlap, session=True, latency_s=lat,
                                     call_s=self.figures.call_s(self.config)).step_s
        resident = sum(u.compute_s for u in plan.units if u.entered)
        bound = lower_bound(plan.units, plan.budget_bytes, bps, plan.measured, overlap, lat)
        return PlanTime(predicted, resident, source, bound)


def _subtree(u: Unit) -> list[nn.Module]:
    """Every module of a unit (its roots' submodules and the owners of its tensors)."""
    mods = list(u.hook_modules)
    for _, m in u.roots:
        mods.extend(m.modules())
    return mods
