"""Units and the plans made from them: what the engine cuts, and how a plan is built.

``UnitPlanner`` owns a module's units (found by ``units.find_units``, plus the parts of every
finer cut made since, with the unit each part was cut from) and turns weights, measurements or a
dry run's figures into a ``Plan`` through the pure functions of ``plan``. It may call ``units``,
``plan`` and ``quant``; it never runs a forward and never touches device memory (the bytes a unit
takes on the device come from ``unit_bytes``, the executor's layout).

The one rule: a plan is a function of the units, the figures and the config it is given; the
planner keeps no per-signature state (the engine caches plans).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Callable

from torch import nn

from . import quant
from .measure import UnitMeasurement
from .plan import BudgetError, Plan, PlanOptions, PlanUnit, budget_error, make_plan, measuring_plan
from .tensors import is_plain_tensor
from .units import Unit, UnitSet, find_units, split_unit


class UnitPlanner:
    def __init__(self, module: nn.Module, config, unit_bytes: Callable[[str], int] | None = None) -> None:
        self.module = module
        self.config = config          # the engine's EngineConfig (replaced when the budget changes)
        self.unit_bytes = unit_bytes  # unit name -> bytes it takes on the device (set by the engine)
        self.block_bytes = 1          # the device allocator's block size (set by the engine)
        self.unitset: UnitSet = find_units(module, config.family)
        self.all: dict[str, Unit] = {}
        self.parent: dict[str, str] = {}
        self._reset()

    # -- units -----------------------------------------------------------------------------

    def _reset(self) -> None:
        self.all = {u.name: u for u in self.unitset.units}
        self._checks: list | None = None
        self.parent = {}  # a part of a finer cut -> the unit it was cut from
        for u in self.unitset.units:
            if any(fnmatch.fnmatchcase(u.name, p) for p in self.config.pinned):
                u.pinned = True
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

    def split(self, name: str, meas: dict[str, UnitMeasurement] | None) -> list[PlanUnit] | None:
        parts = split_unit(self.all[name])
        if not parts:
            return None
        parent = meas.get(name) if meas else None
        for p in parts:
            self.all[p.name] = p
            self.parent.setdefault(p.name, name)
            if meas is None or parent is None:
                continue
            # A part needs at most what the whole unit needed, and it ran only if one of its
            # modules did (a VAE decode runs one convolution of a unit that holds the encoder).
            if p.pinned or not parent.modules or any(id(m) in parent.modules for m in _subtree(p)):
                meas[p.name] = parent
        return [self.plan_unit(p, meas) for p in parts]

    def plan_unit(self, u: Unit, meas: dict[str, UnitMeasurement] | None, pin: bool = False) -> PlanUnit:
        m = meas.get(u.name) if meas is not None else None
        return PlanUnit(u.name, self.unit_bytes(u.name),
                        None if meas is None else (m.peak_bytes if m else 0),
                        None if meas is None else (m.entry_bytes if m else 0),
                        u.pinned or pin, entered=meas is None or m is not None or u.kind == "shared",
                        calls=m.calls if m else 1)

    def pinned_bytes(self) -> int:
        return sum(self.unit_bytes(u.name) for u in self.unitset.units if u.pinned)

    # -- plans -----------------------------------------------------------------------------

    def weight_plan(self, options: PlanOptions | None = None) -> Plan:
        """The plan from weights alone (structural order, activations not measured)."""
        units = [self.plan_unit(u, None) for u in self.unitset.units]
        return make_plan(units, self.config.budget_bytes, options or self.options,
                         lambda n: self.split(n, None), self.unitset.warnings)

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
            if not u.pinned and u.weight_bytes > cap:
                parts = self.split(u.name, None)
                if parts:
                    split.append(u.name)
                    todo.extend(reversed(parts))
                    continue
            units.append(u)
        pinned = sum(u.weight_bytes for u in units if u.pinned)
        if pinned > budget:
            raise budget_error("pinned units", budget, kind="weights", weight_bytes=pinned, activation_bytes=None,
                               min_budget_bytes=pinned, exact=False, detail="it must stay resident")
        slot = max((u.weight_bytes for u in units if not u.pinned and u.weight_bytes <= budget - pinned),
                   default=0)
        return measuring_plan(units, budget, slot, split, self.unitset.warnings)

    def top(self, name: str) -> str:
        while name in self.parent:
            name = self.parent[name]
        return name

    def aggregate(self, meas: dict[str, UnitMeasurement]) -> dict[str, UnitMeasurement]:
        """Measurements of the parts of a finer cut, as the units they were cut from (in the
        order the forward entered them): the plan starts from whole units and cuts again only
        where the budget needs it."""
        out: dict[str, UnitMeasurement] = {}
        for n, m in meas.items():
            t = self.top(n)
            a = out.get(t)
            if a is None:
                out[t] = UnitMeasurement(m.entry_bytes, m.peak_bytes, m.calls, m.modules)
            else:
                a.peak_bytes = max(a.peak_bytes, m.peak_bytes)
                a.calls = max(a.calls, m.calls)
                a.modules = a.modules | m.modules
        return out

    def measured_plan(self, meas: dict[str, UnitMeasurement], source: str) -> Plan:
        """The plan from per-unit figures (measured, or the dry run's), in the order the forward
        entered the units."""
        names = [u.name for u in self.unitset.units]
        entered = [n for n in meas if n in self.all]
        order = entered + [n for n in names if n not in meas]
        split = lambda n: self.split(n, meas)  # noqa: E731
        looped = {n for n in entered if meas[n].calls > 1}
        if looped and self.config.residency:
            # A forward that loops over its units (a video VAE decoding frame by frame) would
            # re-send streamed weights on every pass: keep the looped units resident if they fit.
            units = [self.plan_unit(self.all[n], meas, pin=n in looped) for n in order]
            try:
                return dataclasses.replace(make_plan(units, self.config.budget_bytes, self.options,
                                                     split, self.unitset.warnings), source=source)
            except BudgetError:
                pass
        units = [self.plan_unit(self.all[n], meas) for n in order]
        notes = list(self.unitset.warnings)
        if looped:
            worst = max(meas[n].calls for n in looped)
            notes.append(f"the forward enters {len(looped)} units up to {worst} times; what streams is "
                         f"copied on every pass (a larger budget keeps them resident)")
        return dataclasses.replace(make_plan(units, self.config.budget_bytes, self.options, split, notes),
                                   source=source)


def _subtree(u: Unit) -> list[nn.Module]:
    """Every module of a unit (its roots' submodules and the owners of its tensors)."""
    mods = list(u.hook_modules)
    for _, m in u.roots:
        mods.extend(m.modules())
    return mods
