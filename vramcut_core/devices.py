"""One module on several devices: the engine's side of a placement (``placement.place``).

Owns what spans the devices of one engine: the group of executors (one per device, each with
its own rooms: device memory, copy stream, events, slots; page-locked host masters are shared
per process already), their nested forward (each executor hooks only the units of its range;
the innermost runs the model with the hops installed), the dry run on fake devices that chooses
the hop rule (``runtime.hops``) before anything moves, the plan drawn as one (``combined_plan``)
and the JSON of the devices and hops.

The hop rule: ``KEEP`` (a unit's outputs stay where it computed them) when the dry run on fake
devices, each unit's weights faked on its device, runs the forward without mixing devices;
else ``HOME`` (every unit off the home device returns its outputs home) when that runs; else
the forward cannot run across devices and the engine refuses, naming one device as the way out.
Only a device-mismatch error (``_mixes_devices``) counts against a rule; any other error means the
dry run itself could not run (an operator fake tensors do not support, a bug in the model's code):
the check stops there and the engine says so, as it is, with the same way out.
The dry run counts the hops with the same ``Hops`` the runtime uses, so the plan's hops are the
ones that run (the runtime counts them again on every forward).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from .figures.meters import OverBudget, UnitMeasurement
from .figures.trace import TRACED
from .model.tensors import fmt_bytes
from .one_device import DeviceSide
from .planning.placement import Placement, place
from .planning.budget import BudgetError
from .planning import timeline
from .planning.plan import Plan, PlanTime, Segment
from .planning.report import RunStats
from .runtime import hops as hops_room
from .runtime.hops import HOME, KEEP, Hops

RULES = (KEEP, HOME)

log = logging.getLogger("vramcut")


@dataclasses.dataclass
class HopCheck:
    """The dry run on fake devices: the rule that runs (None: neither does), the hops it made,
    why each rule that failed failed, and ``error``: set where the dry run failed for a reason
    other than mixing devices (then ``rule`` is None and no rule was judged)."""

    rule: str | None
    hops: list[dict]
    reasons: dict[str, str]
    error: str | None = None

    @property
    def bytes(self) -> int:
        return sum(h["bytes"] for h in self.hops)


def unit_devices(placement: Placement, units: Callable[[str], object]) -> list[tuple[object, torch.device]]:
    """``(Unit, device)`` of every unit the placement runs, in execution order."""
    return [(units(placement.units[i].name), torch.device(d.device))
            for d in placement.used for i in range(d.first, d.stop)]


def check_hops(module: nn.Module, placed: Sequence[tuple[object, torch.device]], home: torch.device,
               fn: Callable, args: tuple, kwargs: dict) -> HopCheck:
    """Run ``fn`` on fake tensors with each unit's weights on its device and the inputs on the
    device they are on now (see the module docstring); the user's model is never changed."""
    from .figures.trace import _first_line

    reasons: dict[str, str] = {}
    for rule in RULES:
        try:
            moves = _fake_run(module, placed, home, fn, args, kwargs, rule)
            return HopCheck(rule, moves, reasons)
        except Exception as e:
            why = f"{type(e).__name__}: {_first_line(e)}"
            if not _mixes_devices(e):   # not this rule's fault: another rule would fail the same way
                return HopCheck(None, [], reasons, error=why)
            reasons[rule] = why
    return HopCheck(None, [], reasons)


def _mixes_devices(e: Exception) -> bool:
    """Whether an error of the dry run is an operator given tensors of two devices: fake tensors'
    own device check, or a kernel's (attention checks its query, key and value itself)."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    return isinstance(e, FakeTensorDeviceMismatchError) or (
        isinstance(e, RuntimeError) and "same device" in str(e))


def _fake_run(module, placed, home, fn, args, kwargs, rule) -> list[dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .figures.trace import _active, _Call, _fake_weights, _keep_fakes_in_place, _ModuleState, _restore_weights

    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True)
    state = _ModuleState(module)
    swapped: list[tuple] = []
    hops = Hops(placed, home, rule, device_of=lambda t: t.device, move=lambda t, d: t.to(d), current=False)
    try:
        def fake_input(t):
            where = hops_room._device_of(t)
            f = mode.from_tensor(t)
            if f.device != where:
                with mode:
                    f = f.to(where)
            return f
        fa, fk = tree_map_only(torch.Tensor, fake_input, (args, kwargs))
        _fake_weights(mode, placed, swapped)
        _keep_fakes_in_place(module)
        hops.install()
        _active.depth = getattr(_active, "depth", 0) + 1
        try:
            with mode:
                hops.output(_Call(fn, fa, fk)())
        finally:
            _active.depth -= 1
        return hops.summary()
    finally:
        hops.remove()
        _restore_weights(swapped)
        state.restore()


class DeviceGroup:
    """The executors of one engine, one per device in the user's order; ``home`` is the one
    inputs arrive on. They coexist: none releases another (``SegmentedExecutor.group``)."""

    def __init__(self, make: Callable[[str], object], devices: Sequence[tuple[str, int]], home: str) -> None:
        self.devices = [(torch.device(d), b) for d, b in devices]
        self.executors = [make(d) for d, _ in devices]
        for ex in self.executors:
            ex.group = self
        self.home = torch.device(home)
        self.last_hops: Hops | None = None

    def executor_of(self, device: str):
        return self.executors[[str(d) for d, _ in self.devices].index(str(torch.device(device)))]

    def forward(self, placement: Placement, units: Callable[[str], object], rule: str, fn: Callable,
                args: tuple, kwargs: dict, measure: bool = False):
        """Run ``fn`` with every used device's executor running its part of ``placement``,
        nested (each installs its own hooks; the innermost runs the model with the hops).
        Returns ``(output, {device: RunStats}, measurements by unit in execution order | None)``."""
        parts = [(self.executor_of(d.device), d) for d in placement.used]
        hops = Hops(unit_devices(placement, units), self.home, rule)
        results: dict[str, tuple] = {}

        def call(i: int, *a, **k):
            if i == len(parts):
                hops.install()
                try:
                    return hops.output(fn(*a, **k))
                finally:
                    hops.remove()
            ex, d = parts[i]
            out, stats, meas = ex.forward(d.plan, lambda *a2, **k2: call(i + 1, *a2, **k2), *a, measure=measure,
                                          limit_bytes=d.budget_bytes if measure else None, **k)
            results[d.device] = (stats, meas)
            return out

        out = call(0, *args, **kwargs)
        self.last_hops = hops
        meas = None
        if measure:
            meas = {}
            for d in placement.used:
                meas.update(results[d.device][1] or {})
        return out, {dev: r[0] for dev, r in results.items()}, meas


def combined(stats: dict[str, RunStats]) -> RunStats:
    """One forward on several devices as one forward's stats (bytes and copies summed, the
    largest peak, the slowest device's times)."""
    out = RunStats(forwards=1)
    for s in stats.values():
        out.bytes_streamed += s.bytes_streamed
        out.copies += s.copies
        out.sync_loads += s.sync_loads
        out.resident_loads += s.resident_loads
        for f in ("time_copy_s", "time_load_s", "time_compute_s", "time_wait_s"):
            setattr(out, f, max(getattr(out, f), getattr(s, f)))
        out.peak_device_bytes = max(out.peak_device_bytes, s.peak_device_bytes)
        out.peak_weight_bytes = max(out.peak_weight_bytes, s.peak_weight_bytes)
    return out


def combined_plan(placement: Placement, source: str | None, warnings: Sequence[str] = ()) -> Plan:
    """The placement as one ``Plan`` (every unit, every device's segments in execution order,
    the budgets summed) for what reads one plan: the table, the top-level JSON, the cache."""
    segs: list[Segment] = []
    slots = slot_bytes = 0
    for d in placement.used:
        p = d.plan
        slots, slot_bytes = max(slots, p.slots), max(slot_bytes, p.slot_bytes)
        for s in p.segments:
            segs.append(dataclasses.replace(s, units=tuple(i + d.first for i in s.units)))
    measured = all(u.peak_bytes is not None for u in placement.units)
    warns = tuple(warnings) + tuple(w for d in placement.used for w in d.plan.warnings if w not in warnings)
    return Plan(sum(d.budget_bytes for d in placement.devices), tuple(placement.units), tuple(segs), slots,
                slot_bytes, measured, (), warns, source)


def placement_json(placement: Placement, hops: list[dict], measured_peaks: dict[str, int | None]) -> dict:
    """The plan JSON's "devices", "hops", "hop_bytes_per_call" and "hops_per_call" (the shape the
    node draws): one entry per device in the user's order."""
    from .planning.report import plan_to_json

    devs = []
    for d in placement.devices:
        p = d.plan
        j = plan_to_json(p) if p is not None else None
        devs.append({
            "device": d.device, "budget_bytes": d.budget_bytes,
            "peak_bytes": p.peak_bytes if p else 0, "resident_bytes": p.resident_bytes if p else 0,
            "window_bytes": p.window_bytes if p else 0,
            "activation_bytes": (p.activation_reserve_bytes or 0) if p else 0,
            "streamed_bytes_per_call": p.streamed_bytes_per_forward if p else 0,
            "copies_per_call": p.transfers_per_forward if p else 0,
            "measured_peak_bytes": measured_peaks.get(d.device),
            "segments": j["segments"] if j else [],
        })
    return {"devices": devs, "hops": list(hops), "hop_bytes_per_call": sum(h["bytes"] for h in hops),
            "hops_per_call": len(hops)}


class SeveralDevices(DeviceSide):
    """The engine's device side on several devices (``one_device.OneDevice`` is the other; see
    its module docstring for the interface). The first forward of a shape places its units from
    the dry run (a budget too small is refused before anything moves), chooses the hop rule on
    fake devices, and runs the placement measuring, within each device's budget (stopped before
    passing one, it places again from what it saw); later forwards run the placement made from
    the measured figures."""

    def __init__(self, make: Callable[[str], object], planner, config) -> None:
        self.group = DeviceGroup(make, config.devices, config.device)
        self.executor = self.group.executor_of(config.device)
        self.executors = self.group.executors
        self.planner = planner
        self.low: tuple[tuple[str, int], ...] | None = None   # budgets placed for, where below the config's
        self.refit = None   # plan.Refit: why the placements were made again for new budgets (the engine's)
        self.device_stats: dict[str, RunStats] = {}   # per device, the forwards that ran a placement
        self.last_device_stats: dict[str, RunStats] = {}

    @property
    def config(self):
        return self.planner.config

    def fit(self, low: tuple[tuple[str, int], ...] | None) -> None:
        self.low = low

    def keep(self, devices) -> None:
        if self.low is not None:   # a new shape: placed for no more than either says
            was = dict(self.low)
            self.low = tuple((d, min(b, was.get(d, b))) for d, b in devices)

    def placement(self, shape) -> Placement | None:
        return shape.placed[0] if shape.placed is not None else None

    # -- the lifecycle's forwards ------------------------------------------------------------

    def first(self, shape, tr, fn: Callable, args: tuple, kwargs: dict):
        if tr.measurements is None:
            raise BudgetError("devices", 0, self.config.budget_bytes, message=(
                f"VRAMCut: a plan across devices needs the dry run, which could not run these inputs "
                f"({tr.reason}); name one device (devices={self.config.device}=GIB, or no devices) to run "
                "on one GPU"))
        meas = {n: dataclasses.replace(m) for n, m in tr.measurements.items()}
        pl = self._place(meas, tr)
        check = self._hop_rule(pl, fn, args, kwargs)
        for _ in range(4):
            try:
                out, stats, got = self.group.forward(pl, self.planner.unit, check.rule, fn, args, kwargs, measure=True)
                break
            except OverBudget as e:
                name = self.planner.top(e.unit) if e.unit else None
                if name not in meas:
                    raise
                m = meas[name]
                log.warning("VRAMCut: the first forward on %d devices passed the traced plan in '%s' (%s "
                            "activations); placing again", len(self.config.devices), e.unit,
                            fmt_bytes(e.activation_bytes))
                m.peak_bytes = max(m.peak_bytes, e.activation_bytes) + self.planner.block_bytes
                pl = self._place(meas, tr)
        else:
            raise BudgetError("devices", 0, self.config.budget_bytes, message=(
                "VRAMCut: the first forward across devices passed a device's budget four times; "
                "give the devices more room"))
        meas = shape.measured(self.planner.aggregate(got))
        new = self._place(meas, tr)
        if unit_devices(new, self.planner.unit) != unit_devices(pl, self.planner.unit):
            # the measured figures moved a cut: the hops of the new placement, on fake devices
            check = check_hops(self.planner.module, unit_devices(new, self.planner.unit),
                               torch.device(self.config.device), fn, args, kwargs)
            check = dataclasses.replace(check, rule=check.rule or HOME)
        self._planned(shape, (new, check.rule, check.hops))
        return out, self._stats(stats)

    def place(self, shape, fn: Callable, args: tuple, kwargs: dict) -> None:
        pl = self._place(shape.measurements, shape.trace)
        check = self._hop_rule(pl, fn, args, kwargs)
        self._planned(shape, (pl, check.rule, check.hops))

    def steady(self, shape, last, shapes, notify: Callable, fn: Callable, args: tuple, kwargs: dict):
        pl, rule, _ = shape.placed
        out, stats, _ = self.group.forward(pl, self.planner.unit, rule, fn, args, kwargs)
        over = [(d.device, stats[d.device].peak_device_bytes, d.budget_bytes) for d in pl.used
                if stats[d.device].peak_device_bytes > d.budget_bytes]
        return out, self._stats(stats), over

    def preview(self, meas) -> Plan:
        return combined_plan(self._place(meas, None), TRACED)

    def plan_json(self, shape, out: dict) -> dict:
        if shape is None or shape.placed is None:
            return out
        pl, rule, dry = shape.placed
        ran = self.group.last_hops.summary() if self.group.last_hops is not None else dry
        extra = placement_json(pl, ran, {d: s.peak_device_bytes for d, s in self.device_stats.items()})
        out.update(extra)
        out["hop_rule"] = rule
        out["peak_bytes"] = sum(d["peak_bytes"] for d in extra["devices"])
        out["window_bytes"] = sum(d["window_bytes"] for d in extra["devices"])
        return out

    # -- inside ------------------------------------------------------------------------------

    def _planned(self, shape, placed: tuple) -> None:
        plan = combined_plan(placed[0], TRACED, shape.again_warnings)
        if self.refit is not None:
            plan = dataclasses.replace(plan, refit=self.refit)
        shape.planned_as(dataclasses.replace(plan, time=self._time(placed[0], placed[2])), placed)

    def _time(self, pl: Placement, hops: list[dict]) -> PlanTime | None:
        """The placement's predicted call (``timeline.predict_devices``: each device's part, its
        hops at its link's measured rate), where every part is timed (``UnitPlanner.timed``) and
        every link a hop crosses is measured (``speed.Figures.link``); else None."""
        parts = pl.used
        if not parts or any(d.plan.time is None for d in parts):
            return None
        index = {d.device: i for i, d in enumerate(parts)}
        moves = [(h["src"], h["dst"], h["unit"], h["bytes"]) for h in hops]
        if any(a not in index or b not in index for a, b, _, _ in moves):
            return None  # a hop from a device given no units (the home one): not modelled
        links = {}
        for a, b, _, _ in moves:
            if (index[a], index[b]) not in links:
                room = min(dict(self.config.devices)[d] - self.group.executor_of(d).device_bytes for d in (a, b))
                links[(index[a], index[b])] = self.planner.figures.link(a, b, max(room, 0))
        if None in links.values():
            return None
        fig = self.planner.figures
        tl = timeline.predict_devices([d.plan for d in parts], [(index[a], index[b], u, n) for a, b, u, n in moves],
                                      fig.bytes_per_s(self.config), links, latency_s=fig.latency_s(self.config),
                                      call_s=fig.call_s(self.config))
        return PlanTime(tl.step_s, sum(d.plan.time.resident_s for d in parts), parts[0].plan.time.source)

    def _stats(self, stats: dict[str, RunStats]) -> RunStats:
        for dev, st in stats.items():
            self.device_stats.setdefault(dev, RunStats()).add(st)
        self.last_device_stats = stats
        return combined(stats)

    def _place(self, meas: dict[str, UnitMeasurement], tr) -> Placement:
        """The placement of the units on the config's devices from per-unit figures (in the order
        the forward entered them; FLOPs the real forward does not count come from the dry run
        ``tr``); a ``BudgetError`` when no placement fits."""
        pl = self.planner
        order = [n for n in meas if n in pl.all] + [u.name for u in pl.unitset.units if u.name not in meas]
        # where the config chooses by time: the units' compute times (the dry run's FLOPs over the
        # measured throughput), the placement's time tie-break, and each device's residency by time
        counted = {n: m.flops for n, m in ((tr.measurements if tr is not None else None) or {}).items()}
        seconds, source = pl.compute_seconds({n: m if m.flops is not None or n not in counted else
                                              dataclasses.replace(m, flops=counted[n]) for n, m in meas.items()})
        bps = pl.figures.bytes_per_s(self.config) if seconds is not None else None
        units = [pl.plan_unit(pl.all[n], meas, seconds=seconds) for n in order]
        # what stays home while a unit computes elsewhere (everything outside the units: a UNet's
        # skips, the tensors its inputs were moved from): at most the unit's peak as one device
        # sees it, the dry run's (a device measures only what is on it) or the measured, larger
        traced = (tr.measurements if tr is not None else None) or {}
        held = [max(u.peak_bytes or 0, traced[u.name].peak_bytes if u.name in traced else 0) for u in units]
        home = str(torch.device(self.config.device))
        placed = None
        low = self.low   # a fallen budget placed a margin below it where that fits (``Engine.set_devices``)
        for budgets in ([low] if low is not None and low != self.config.devices else []) + [self.config.devices]:
            try:
                placed = place(units, list(budgets), pl.options, warnings=pl.unitset.warnings, bytes_per_s=bps,
                               home=home, held=held)
                break
            except BudgetError:
                if budgets is self.config.devices:
                    raise
        if not bps:
            return placed
        return dataclasses.replace(placed, devices=tuple(
            d if d.plan is None else dataclasses.replace(d, plan=pl.timed(d.plan, source)) for d in placed.devices))

    def _hop_rule(self, pl: Placement, fn: Callable, args: tuple, kwargs: dict) -> HopCheck:
        """The hop rule of placement ``pl`` from the dry run on fake devices (``check_hops``); a
        ``BudgetError`` naming one device as the way out where no rule runs."""
        check = check_hops(self.planner.module, unit_devices(pl, self.planner.unit), torch.device(self.config.device),
                           fn, args, kwargs)
        if check.rule is None:
            why = (f"the dry run across devices could not run: {check.error}" if check.error else
                   "this model's forward mixes tensors of different devices between its blocks under any "
                   f"hop rule ({'; '.join(f'{r}: {why}' for r, why in check.reasons.items())})")
            raise BudgetError("devices", 0, self.config.budget_bytes, message=(
                f"VRAMCut: {why}; name one device (devices={self.config.device}=GIB, or no devices) to run "
                "on one GPU"))
        return check
