"""Residency and host tiers chosen together (vramcut_core.planning.joint): the residency chosen by
time sees the reads of the units it streams from disk. Under the model, a residency chosen as if
every streamed unit were copied from RAM (then given its tiers) is slower than the one searched
with the reads, on a UNet-like model under a small RAM budget, with reads hidden
on the reader lane (CPU) and with reads not hidden (added whole); never slower on random models;
and the search times a residency with reads as ``predict`` times its plan.

Sizes and times are relative figures of the kind these models have (see test_residency): they
shape the cases; none is a measurement."""
from __future__ import annotations

import dataclasses
import random

import pytest

from test_residency import unet
from vramcut_core import PlanOptions, PlanUnit, build_plan
from vramcut_core.planning import joint, tiers
from vramcut_core.planning.residency import _Search, by_time, step_time
from vramcut_core.planning.timeline import predict

MB = 1 << 20
GIB = 1 << 30


def _host(units):
    return {u.name: tiers.HostUnit(u.weight_bytes, u.weight_bytes) for u in units}


def _blind(plan, host, ram, bounce, bw, disk, overlap, lane):
    """Today's order: residency by time without the reads, then the tiers for it."""
    p = by_time(plan, bw, overlap=overlap)
    step_of = (lambda reads: predict(p, bw, overlap, True, 0.0, reads, disk).step_s) if lane else None
    p = dataclasses.replace(p, tiers=tiers.choose(p, host, ram, bounce, disk, step_of))
    return p, joint.step_with_reads(p, host, bw, disk, overlap, 0.0, lane)


@pytest.mark.parametrize("lane, overlap, bw", [(True, False, 10e9), (False, True, 25e9)], ids=["lane", "added"])
@pytest.mark.parametrize("case, units, budget", [("unet_2gib", unet(), 2 * GIB)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_residency_that_sees_the_reads_is_faster_than_residency_blind_to_them(lane, overlap, bw, case, units,
                                                                              budget):
    host, disk, ram, bounce = _host(units), 2e9, GIB, 128 * MB
    count = build_plan(units, budget)
    blind, t_blind = _blind(count, host, ram, bounce, bw, disk, overlap, lane)
    seen = joint.fastest(by_time(count, bw, overlap=overlap), host, ram, bounce, bw, disk, overlap=overlap,
                         lane=lane)
    t_seen = joint.step_with_reads(seen, host, bw, disk, overlap, 0.0, lane)
    assert t_seen < t_blind * 0.98, (case, t_seen, t_blind)
    assert seen.peak_bytes <= budget and seen.tiers.host_bytes <= ram
    assert seen.tiers.disk_units and set(seen.tiers.disk_units) <= {u.name for u in units}


def test_residency_that_sees_the_reads_is_never_slower_on_random_models():
    rnd = random.Random(40)
    for _ in range(8):
        units = [PlanUnit(f"u{i}", int(rnd.choice([1, 2, 4, 8, 16, 30]) * 1e6 * rnd.uniform(0.75, 1.25)),
                          compute_s=rnd.choice([0.5, 1, 2, 4, 10]) * 1e-3) for i in range(rnd.randint(5, 9))]
        lo, total = max(u.weight_bytes for u in units), sum(u.weight_bytes for u in units)
        count = build_plan(units, int(2 * lo + rnd.random() * (total - 2 * lo)) + 1)
        if not count.streamed_order:
            continue
        host, lane = _host(units), rnd.random() < 0.5
        overlap, bw, disk = not lane, rnd.choice([1e9, 1e10]), rnd.choice([5e8, 3e9])
        ram = int(rnd.random() * total)
        _, t_blind = _blind(count, host, ram, 0, bw, disk, overlap, lane)
        seen = joint.fastest(by_time(count, bw, overlap=overlap), host, ram, 0, bw, disk, overlap=overlap, lane=lane)
        assert joint.step_with_reads(seen, host, bw, disk, overlap, 0.0, lane) <= t_blind * (1 + 1e-9)


@pytest.mark.parametrize("lane", [True, False])
def test_the_search_times_a_residency_with_reads_as_predict_times_its_plan(lane):
    rnd = random.Random(41)
    for _ in range(40):
        units = [PlanUnit(f"u{i}", rnd.randint(1, 200) * MB, 4 * MB, 2 * MB, compute_s=rnd.uniform(0, 0.05),
                          entered=i % 4 != 3, calls=1 + (i % 5 == 2)) for i in range(rnd.randint(2, 9))]
        overlap = rnd.random() < 0.5
        try:
            count = build_plan(units, rnd.randint(300, 1200) * MB)
        except Exception:
            continue
        reads = {u.name: u.weight_bytes for u in units if rnd.random() < 0.6}
        s = _Search(count, 1e9, PlanOptions(), overlap, True, 0.0, reads, 3e8, lane)
        res = s.must | frozenset(i for i in s.free if rnd.random() < 0.5)
        t = s.timed(res)
        if t is None:
            continue
        (step, _, _), slots, size, _ = t
        plan = s.plan_of(res, slots, size)
        assert step == pytest.approx(step_time(plan, 1e9, overlap, True, 0.0, reads, 3e8, lane), rel=1e-12, abs=1e-15)


class _Host:
    """The executor's host side as the planner asks it (``runtime.host_tiers.HostTiers``): every
    unit read from a file at 2 GB/s through a 128 MiB bounce buffer."""

    def __init__(self, units):
        self.units = _host(units)

    def host_unit(self, name):
        return self.units[name]

    def bounce_bytes(self, host):
        return 128 * MB

    def disk_rate(self, names):
        return 2e9


def test_the_planner_times_the_residency_with_the_reads_of_its_tiers():
    # the planner's order (residency by time, then the tiers) on CPU, where reads run ahead on the
    # reader lane: the plan it keeps under a 1 GiB RAM budget is the one searched with the reads
    import torch

    from toys import TransformerStack
    from vramcut_core import EngineConfig
    from vramcut_core.planning.plan import PlanTime
    from vramcut_core.planning.planner import UnitPlanner

    units, bw = unet(), 10e9
    config = EngineConfig(budget_bytes=2 * GIB, device="cpu", speed="time", bandwidth_bytes_per_s=bw,
                          flops_per_s=1e9, ram_budget_bytes=GIB)
    planner = UnitPlanner(TransformerStack(d=8).to(torch.float32), config, lambda n: 0)
    planner.host = _Host(units)
    timed = by_time(build_plan(units, 2 * GIB), bw, overlap=False)
    timed = dataclasses.replace(timed, time=PlanTime(step_time(timed, bw, False), 0.0, "flops"))
    blind, t_blind = _blind(timed, planner.host.units, GIB, 128 * MB, bw, 2e9, False, True)
    out = planner.tiered(timed)
    t_out = joint.step_with_reads(out, planner.host.units, bw, 2e9, False, 0.0, True)
    assert t_out < t_blind * 0.98, (t_out, t_blind)
    assert out.tiers.predicted_step_s == pytest.approx(t_out, rel=1e-12)
    assert out.time.predicted_s == pytest.approx(step_time(out, bw, False), rel=1e-12)
    assert out.time.bound_s <= out.time.predicted_s and out.source == timed.source
