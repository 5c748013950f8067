"""Time on the simulated accelerator: copies and kernels with durations (``sim.set_durations``).

A copy from host memory takes its bytes over the simulated link, an operator its FLOPs (torch's
count, as the dry run's) over a simulated throughput; each stream keeps a virtual clock that
honours event waits, so the executor's measured time per forward shows what its prefetch hid.
The engine is given the same two figures (``EngineConfig.bandwidth_bytes_per_s``,
``flops_per_s``): its plan's prediction (``timeline.predict``) must match the simulator's measured
time per forward, where copies hide and where they do not; the plan chosen by time must run faster
than the count-based one where blocks differ; and the budget that follows free memory re-plans only
when the plan no longer fits (or the budget grew well past it), never on a wobble.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from sim_cuda import flop_seconds
from test_sim_cuda import sim  # noqa: F401  (the fixture)
from timed_plans import FLOPS, Block, D, N  # width, tokens, the simulated throughput, an MLP block
from toys import seeded
from vramcut_core import Engine, EngineConfig, plan_to_json, plan_to_text
from vramcut_core.planning.plan import refit_reason
from vramcut_core.model.tensors import MIB


class Stack(nn.Module):
    def __init__(self, blocks) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(sim, blocks):
    with sim.host_memory(), torch.no_grad():
        model = seeded(Stack(blocks))
        x = torch.randn(1, N, 8, generator=torch.Generator().manual_seed(1))
        return model, x, model(x)


def engine(model, budget, bps, **kw):
    return Engine(model, EngineConfig(budget_bytes=budget, device="cuda", bandwidth_bytes_per_s=bps,
                                      flops_per_s=FLOPS, **kw))


def steady_time(eng, model, x, ref, warm=3, timed=4) -> float:
    """Measured seconds per forward once the plan is steady (after the measuring forward and the
    plan made again from its measured unit times), every output bit-equal to ``ref``."""
    with torch.no_grad(), eng.session():
        for _ in range(warm):
            assert torch.equal(eng.run(model, x), ref)
        eng.reset_stats()
        for _ in range(timed):
            assert torch.equal(eng.run(model, x), ref)
    assert eng.steady_stats.timed == timed
    return eng.steady_stats.s_per_forward


@pytest.mark.parametrize("bps, hidden", [(2e9, True), (2e7, False)], ids=["copies-hide", "copies-stall"])
def test_the_simulators_time_per_forward_is_the_plans_prediction(sim, bps, hidden):
    sim.set_durations(copy_bytes_per_s=bps, op_seconds=flop_seconds(FLOPS))
    model, x, ref = build(sim, [Block(256, 2) for _ in range(8)])
    weights = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    eng = engine(model, weights // 2, bps)
    measured = steady_time(eng, model, x, ref)
    plan = eng.last_plan
    assert plan.streamed_order and plan.slots == 2, "the case must stream with prefetch"
    assert plan.time is not None and plan.time.source == "measured"
    assert measured == pytest.approx(plan.time.predicted_s, rel=0.02)
    stall = plan.time.predicted_s - plan.time.resident_s
    if hidden:
        assert stall < 0.01 * plan.time.resident_s, "fast copies hide behind compute"
    else:
        assert stall > 0.5 * plan.time.resident_s, "slow copies do not hide"
    # the report: predicted, then measured with the prediction's error
    j = plan_to_json(plan, eng.stats, eng.steady_stats)["time"]
    assert j["measured_s"] == pytest.approx(measured) and abs(j["error"]) < 0.02
    assert j["predicted_s"] == plan.time.predicted_s and j["resident_s"] == plan.time.resident_s
    line = [l for l in plan_to_text(plan, stats=eng.stats, steady=eng.steady_stats).splitlines()
            if l.startswith("predicted +")]
    assert len(line) == 1 and "× resident" in line[0] and "measured" in line[0] and "error" in line[0]


def test_the_measured_unit_times_replace_the_flop_estimate(sim):
    sim.set_durations(copy_bytes_per_s=2e8, op_seconds=flop_seconds(FLOPS))
    model, x, ref = build(sim, [Block(256, 1 + i % 3) for i in range(6)])
    eng = engine(model, 1 << 30, 2e8)
    with torch.no_grad():
        plan = eng.preview_as(("x",), model, x)
    assert plan.time.source == "flops"
    est = {u.name: u.compute_s for u in plan.units}
    steady_time(eng, model, x, ref, warm=2, timed=1)
    plan = eng.last_plan
    assert plan.time.source == "measured"
    # the simulator's kernels take their FLOPs over the same throughput: the measured times are
    # the estimate (measured between unit entries on the compute stream, copies left out)
    for u in plan.units:
        assert u.compute_s == pytest.approx(est[u.name], rel=1e-6, abs=1e-12), u.name
    assert est["blocks.2"] == pytest.approx(3 * est["blocks.0"])


def test_the_plan_chosen_by_time_runs_faster_than_the_count_based_one(sim):
    """Big blocks whose compute hides their copy, then small blocks that compute little: the
    count-based plan keeps the big ones resident and stalls on the small ones' copies; by time the
    big ones stream behind their own compute and the small ones stay."""
    bps = 5e7
    sim.set_durations(copy_bytes_per_s=bps, op_seconds=flop_seconds(FLOPS))
    blocks = lambda: [Block(512, 8) for _ in range(4)] + [Block(256, 1) for _ in range(4)]  # noqa: E731
    model, x, ref = build(sim, blocks())
    big = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    small = sum(p.numel() * p.element_size() for p in model.blocks[4].parameters())
    budget = 4 * big + 2 * small + 64 * 1024
    times, plans = {}, {}
    for speed in ("count", "time"):
        eng = engine(model, budget, bps, speed=speed)
        times[speed] = steady_time(eng, model, x, ref)
        plans[speed] = eng.last_plan
    assert plans["count"].time is None and plans["time"].time is not None
    assert plans["count"].resident_units != plans["time"].resident_units
    assert times["time"] < 0.95 * times["count"], times
    assert times["time"] == pytest.approx(plans["time"].time.predicted_s, rel=0.02)


def test_unit_times_are_read_without_waiting(sim):
    """A measuring forward's unit clock is read only once its last mark has completed: asked
    before, it answers None and the host waits for nothing."""
    from vramcut_core.runtime.measuring import UnitClock

    side = torch.cuda.Stream()
    with sim.host_memory():
        src = torch.ones(1 << 12)
    dst = torch.empty(1 << 12)  # device memory
    clock = UnitClock(torch.device("cuda"))
    side.wait_stream(torch.cuda.current_stream())  # dst was made on the compute stream
    with torch.cuda.stream(side):
        dst.copy_(src.pin_memory(), non_blocking=True)  # still in flight: nothing has waited for it
        clock.start("a")
        clock.stop()
    syncs = sim.host_syncs
    assert clock.seconds() is None and sim.host_syncs == syncs
    side.synchronize()
    assert set(clock.seconds()) == {"a"}


# -- the budget follows free memory ------------------------------------------------------------

def test_refit_keeps_a_plan_that_still_fits_and_replans_past_the_margin():
    from vramcut_core.planning.plan import Plan, PlanUnit, build_plan

    units = [PlanUnit(f"b{i}", 100, 10, 5) for i in range(8)]
    plan = build_plan(units, 500)
    assert isinstance(plan, Plan) and plan.streamed_order
    assert refit_reason(plan, plan.peak_bytes) is None
    assert refit_reason(plan, 540) is None                  # grew by less than the margin
    assert "grew" in refit_reason(plan, 560)
    assert "below the plan's peak" in refit_reason(plan, plan.peak_bytes - 1)
    resident = build_plan(units, 2000)
    assert not resident.streamed_order and refit_reason(resident, 4000) is None  # nothing to gain


def test_the_budget_follows_free_memory_another_program_takes(sim, caplog):
    """Another program allocates device memory between steps; before each step the budget is
    read again from the simulator's free memory (the engine's own bytes and the allocator's cache counted as free) less a
    reserve: the plan is made again when it no longer fits, the reserved peak stays under each
    step's budget, the output is unchanged, and a wobble around the new budget plans nothing."""
    sim.total_memory = 8 * MIB
    model, x, ref = build(sim, [Block(512, 1) for _ in range(12)])
    weights = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    reserve, wobble = MIB, 64 * 1024
    others: list[torch.Tensor] = []

    def take(nbytes: int) -> None:  # the other program
        others.append(torch.empty(nbytes, dtype=torch.uint8))  # outside host_memory(): device memory

    eng = Engine(model, EngineConfig(budget_bytes=free_budget_of_empty(sim, reserve), device="cuda", speed="count"))
    budgets, peaks, plans = [], [], []
    with torch.no_grad(), eng.session(), caplog.at_level(logging.WARNING, logger="vramcut"):
        for i in range(7):
            if i == 2:
                take(free_budget(eng, reserve) - (2 * weights) // 3 - wobble)  # leaves two thirds of the weights' room
                take(wobble)
            elif i in (3, 5):    # the program gives a little back (another process: back to the driver)
                others.pop()
                sim.alloc.empty_cache()
            elif i in (4, 6):    # and takes it again: the budget wobbles above the one planned for
                take(wobble)
            step_at_free_budget(sim, eng, model, x, ref, reserve, budgets, peaks, plans)
    assert all(p <= b for p, b in zip(peaks, budgets)), list(zip(peaks, budgets))
    assert not plans[0].streamed_order, "all resident while the device is free"
    assert plans[1] is plans[0]
    assert plans[2] is not plans[1] and plans[2].streamed_order, "the program took the room: planned again"
    refit = plans[2].refit
    assert refit is not None and refit.budget_bytes == budgets[2] and "below the plan's peak" in refit.reason
    assert refit.previous_budget_bytes == plans[0].budget_bytes
    assert budgets[3] > budgets[2] and budgets[4] == budgets[2]
    assert all(p is plans[2] for p in plans[3:]), "a wobble plans nothing again"
    assert sum("planning again" in r.getMessage() for r in caplog.records) == 1
    assert plan_to_json(plans[2])["refit"]["budget_bytes"] == budgets[2]


def free_budget_of_empty(sim, reserve: int) -> int:
    free, _ = torch.cuda.mem_get_info()
    return free - reserve


def free_budget(eng, reserve: int) -> int:
    """'Free VRAM minus reserve' as the host reads it: the allocator's cached blocks and what the
    engine holds count as free."""
    free, _ = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return free + cached + eng.held_bytes - reserve


def step_at_free_budget(sim, eng, model, x, ref, reserve: int, budgets: list, peaks: list, plans: list) -> None:
    """One step as a host re-reading free memory runs it: the budget read again, the call (its
    output the plain model's), and the budget, the step's reserved peak and its plan recorded."""
    b = free_budget(eng, reserve)
    eng.set_budget(b)
    sim.alloc.reset_peak()
    base = sim.alloc.reserved - eng.held_bytes
    assert torch.equal(eng.run(model, x), ref)
    budgets.append(b)
    peaks.append(sim.alloc.max_reserved - base)
    plans.append(eng.last_plan)


def test_memory_taken_in_small_steps_replans_once(sim, caplog):
    """Another program takes device memory a little at a time, step after step: the first step
    that leaves the plan without room plans again a margin below the new budget
    (``plan.REFIT_DOWN_MARGIN``), so the smaller drops after it keep that plan: one re-plan, not
    one per step; the peak stays under every step's budget and the output is unchanged. Each small
    bite is just enough that a plan made for the budget before it, with no margin, would no longer
    fit (so without the margin every bite plans again)."""
    from vramcut_core.planning.plan import REFIT_DOWN_MARGIN

    sim.total_memory = 8 * MIB
    model, x, ref = build(sim, [Block(64, 1) for _ in range(64)])
    weights = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    reserve = MIB
    others: list[torch.Tensor] = []

    def tight_peak(eng, budget) -> int:  # the peak of a plan made for ``budget`` with no margin
        sig = eng.last_signature
        return eng.planner._measured_plan(eng.measurements[sig], eng.last_plan.source, None, budget).peak_bytes

    eng = Engine(model, EngineConfig(budget_bytes=free_budget_of_empty(sim, reserve), device="cuda", speed="count"))
    budgets, peaks, plans = [], [], []
    with torch.no_grad(), eng.session(), caplog.at_level(logging.WARNING, logger="vramcut"):
        for i in range(5):
            if i == 2:  # the first bite leaves room for two thirds of the weights
                others.append(torch.empty(free_budget(eng, reserve) - (2 * weights) // 3, dtype=torch.uint8))
            elif i > 2:  # then small bites
                b = free_budget(eng, reserve)
                others.append(torch.empty(b - tight_peak(eng, b) + 1, dtype=torch.uint8))
            step_at_free_budget(sim, eng, model, x, ref, reserve, budgets, peaks, plans)
    assert all(p <= b for p, b in zip(peaks, budgets)), list(zip(peaks, budgets))
    assert budgets[2:] == sorted(budgets[2:], reverse=True) and budgets[-1] < budgets[3] < budgets[2]
    assert plans[2] is not plans[1] and plans[2].streamed_order, "the program took the room: planned again"
    assert plans[2].budget_bytes <= budgets[2] * (1 - REFIT_DOWN_MARGIN) + 1
    assert plans[2].refit is not None and plans[2].refit.budget_bytes == budgets[2]
    assert all(p is plans[2] for p in plans[3:]), "small drops after the re-plan keep it"
    assert sum("planning again" in r.getMessage() for r in caplog.records) == 1
    assert budgets[-1] > budgets[2] * (1 - REFIT_DOWN_MARGIN), "the small bites stay within the margin"
