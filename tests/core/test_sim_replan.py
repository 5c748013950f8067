"""A steady forward that outgrows its plan, on the simulated accelerator.

A block's temporary grows after the plan was made (a longer prompt held by the host, a host change
in attention): the input signature is the same, so the cached plan runs. Every forward reads the
allocator's peak (statistics calls, no host sync), so the first forward over the budget is seen:
the engine logs why, measures the next forward again and plans once more, and every later
forward is within the budget again, with no host sync and no ``empty_cache`` per steady step.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from test_sim_cuda import budget_for, cuda_engine, ids, sim  # noqa: F401  (sim: the fixture)
from toys import MLPBlock, seeded


class GrowingBlock(MLPBlock):
    """An MLP block whose forward makes a temporary of ``extra`` floats once it is set (freed
    before the block returns; the output is unchanged)."""

    extra = 0

    def forward(self, x):
        if GrowingBlock.extra:
            scratch = torch.ones(GrowingBlock.extra)
            return super().forward(x) + (scratch[0] - 1)
        return super().forward(x)


class GrowingStack(nn.Module):
    def __init__(self, d: int = 32, depth: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.blocks = nn.ModuleList(GrowingBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, 8)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_steady_forward_over_the_budget_replans_once_and_later_ones_fit(sim, caplog, monkeypatch):
    monkeypatch.setattr(GrowingBlock, "extra", 0)
    with sim.host_memory():
        model = seeded(GrowingStack())
        x = ids()
    with torch.no_grad():
        ref = model(x)
        budget = budget_for(model, x, share=0.6)
        eng = cuda_engine(model, budget)
        peaks, exact, syncs, caches = [], [], [], []
        plans = set()
        with eng.session(), caplog.at_level(logging.WARNING, logger="vramcut"):
            for i in range(1, 10):
                if i == 4:  # the temporary grows past what the plan left free
                    first = eng.last_plan
                    over = budget - first.peak_bytes + 16 * 1024
                    GrowingBlock.extra = over // 4
                s, c = sim.host_syncs, sim.empty_cache_calls
                exact.append(torch.equal(eng.run(model, x), ref))
                syncs.append(sim.host_syncs - s)
                caches.append(sim.empty_cache_calls - c)
                peaks.append(eng.last_stats.peak_device_bytes)
                plans.add(id(eng.last_plan))
    assert all(exact)
    warned = [r.getMessage() for r in caplog.records if "above the budget" in r.getMessage()]
    assert len(warned) == 1 and "forward 4 " in warned[0], warned
    assert peaks[3] > budget, f"forward 4 ran over the budget and must be seen: {peaks}"
    assert all(0 < p <= budget for p in peaks[4:]), f"after the re-plan every forward fits: {peaks} > {budget}"
    assert all(0 < p <= budget for p in peaks[:3])
    assert eng.last_plan is not first and eng.last_plan.activation_reserve_bytes > first.activation_reserve_bytes
    assert any("planned again: forward 4" in w for w in eng.last_plan.warnings), eng.last_plan.warnings
    # forward 5 measures, forward 6 switches to the new plan; then steady steps again
    assert syncs[1:3] == [0, 0] and syncs[6:] == [0, 0, 0], syncs
    assert caches[1:3] == [0, 0] and caches[6:] == [0, 0, 0], caches


def test_plan_figures_are_the_allocators_rounded_figures(sim):
    """The plan counts each buffer as the caching allocator rounds it: the weights a plan
    promises are the bytes the allocator reports for the executor's buffers, and a unit's figure
    is its rounded flat buffer (here no unit is a multiple of the allocator's block)."""
    from vramcut_core.runtime.device_memory import alloc_size

    with sim.host_memory():
        model = seeded(GrowingStack(d=18, depth=6))  # 18-wide layers: sizes off the 512 B grid
        x = ids()
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x, share=0.6))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            gc_before = sim.alloc.allocated
            plan = eng.last_plan
            assert plan.slots and plan.resident_units, "the scenario streams and keeps some resident"
            assert eng.executor.device_bytes == plan.resident_bytes + plan.window_bytes
            lays = {n: eng.executor.memory.layout(n).nbytes for n in [u.name for u in plan.units]}
            assert any(n % 512 for n in lays.values())
            assert all(u.weight_bytes == alloc_size(lays[u.name]) for u in plan.units)
        assert gc_before - sim.alloc.allocated == plan.resident_bytes + plan.window_bytes, \
            "the allocator frees exactly the bytes the plan counted"
    for n in (1, 512, 513, 1 << 20, (10 << 20) + 1):  # a large buffer: a segment of its own, 2 MiB-rounded
        before = sim.alloc.reserved
        t = torch.empty(n, dtype=torch.uint8)
        assert sim.alloc.reserved - before <= alloc_size(n)
        if n >= 10 << 20:
            assert sim.alloc.reserved - before == alloc_size(n) == 12 << 20
        del t
        sim.alloc.empty_cache()
