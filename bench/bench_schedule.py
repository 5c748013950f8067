"""The schedule on the simulated accelerator: the timeline's predicted call against the executor's
simulated one, per family and over random plans.

    python bench/bench_schedule.py [--doc]

The executor's CUDA branch runs on the simulated accelerator (tests/sim_cuda.py) with durations:
a copy from host memory takes its bytes over ``BPS``, an operator its FLOPs (torch's count, as
the dry run's) over ``FLOPS``; events carry those times, so the executor's own timing shows what
its copies hid. The same two figures are given to the engine (``EngineConfig.bandwidth_bytes_per_s``,
``flops_per_s``, residency by time), whose plan carries its predicted steady call (``Plan.time``,
``timeline.predict`` of the plan's schedule). Per family of bench/bench_predict.py (smaller: the
simulator runs Python at every operator), under the smallest budget for its shape plus half its
weights at two link speeds: the engine's steady call (after its measuring and timed calls) against
its plan's prediction. Then the plans of tests/core/test_sim_schedule.py (stacks of MLP blocks,
each streamed or resident, one or two slots, in a session or not, three link speeds, one in three
looping over a run of its blocks): the worst
error of the steady call and of a session's first call over ``RANDOM`` random plans. Not a GPU:
it checks the model against the executor's schedule, not against a device.

Then the disk read stage, on CPU (the simulated accelerator has no disk): stacks of blocks whose
weights are mapped from a checkpoint, read each call under a RAM budget on the real reader
thread, the reads throttled to ``DISK_BPS`` (the figure the planner is given for the disk) and
each block's compute a matrix product plus a sleep (a kernel that holds no GIL): the engine's
steady call (wall time) against its plan's predicted step with the reads
(``Tiers.predicted_step_s``: the timeline's reader lane, the RAM tier chosen by it).
``--doc`` rewrites the generated section of docs/measurements.md (stamped: bench/docgen.py).
"""
from __future__ import annotations

import argparse
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "core")):
    if p not in sys.path:
        sys.path.insert(0, p)

FLOPS = 1e9
LINKS = (("copies hide", 2e9), ("copies stall", 2e7))
RANDOM = 300


def families():
    import torch

    import toys
    g = torch.Generator().manual_seed(0)
    return {
        "transformer": (lambda: toys.seeded(toys.TransformerStack(d=64, depth=8, vocab=128)),
                        (torch.randint(0, 128, (1, 32), generator=g),)),
        "flux-like": (lambda: toys.seeded(toys.FluxLike(d=64, n_double=4, n_single=6)),
                      (torch.randn(1, 32, 16, generator=g), torch.rand(1, generator=g))),
        "unet-like": (lambda: toys.seeded(toys.UNetLike(ch=16, levels=3)),
                      (torch.randn(1, 4, 32, 32, generator=g), torch.rand(1, generator=g))),
    }


def family_row(sim, name, build, args, bps) -> str:
    import torch

    from sim_cuda import flop_seconds
    from vramcut_core import Engine, EngineConfig, find_units

    sim.set_durations(copy_bytes_per_s=bps, op_seconds=flop_seconds(FLOPS))
    with sim.host_memory(), torch.no_grad():
        model = build()
        ref = model(*args)
    weights = find_units(model).weight_bytes
    probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cuda", bandwidth_bytes_per_s=bps,
                                       flops_per_s=FLOPS, speed="count"))
    with torch.no_grad():
        probe.run(model, *args)
    probe.release()
    budget = probe.last_plan.activation_reserve_bytes + 2 * max(
        u.weight_bytes for u in probe.last_plan.units) + weights // 2
    eng = Engine(model, EngineConfig(budget_bytes=budget, device="cuda", bandwidth_bytes_per_s=bps,
                                     flops_per_s=FLOPS, speed="time"))
    with torch.no_grad(), eng.session():
        for _ in range(3):
            assert torch.equal(eng.run(model, *args), ref)
        eng.reset_stats()
        for _ in range(4):
            assert torch.equal(eng.run(model, *args), ref)
    plan = eng.last_plan
    measured = eng.steady_stats.s_per_forward
    pred = plan.time.predicted_s
    return (f"{name:12s} {bps / 1e9:5.2f} GB/s  measured {measured * 1e3:8.3f} ms, predicted {pred * 1e3:8.3f} ms, "
            f"error {pred / measured - 1:+6.2%}  ({len(plan.streamed_groups)} streamed groups, "
            f"{len(plan.resident_units)} resident units, {plan.slots} slots)")


def random_rows(sim) -> list[str]:
    import timed_plans as tp

    rng = random.Random(38)
    worst = worst_first = 0.0
    n_first = n_loop = 0
    for _ in range(RANDOM):
        err, first, drawn = tp.random_errors(sim, rng)
        n_loop += drawn[4] is not None
        worst = max(worst, err)
        if first is not None:
            n_first += 1
            worst_first = max(worst_first, first)
    return [f"{RANDOM} random plans (4-8 blocks, each streamed or resident, 1 or 2 slots, 3 link speeds, "
            f"{n_first} in a session, {n_loop} looping over a run of blocks): steady call worst |error| {worst:.3%}, first call of a session "
            f"worst |error| {worst_first:.3%}"]


DISK_BPS = 140e6                     # the throttled disk: a 4 MiB block reads in about 30 ms
DISK_ROWS = (  # (compute seconds per block, budget as a share of the weights, RAM budget bytes)
    ((0.02,) * 8, 0.45, 1 << 20),
    ((0.04,) * 8, 0.45, 1 << 20),
    ((0.03, 0.01) * 4, 0.3, 1 << 20),
    ((0.03, 0.01) * 4, 0.3, 12 << 20),
)


def disk_rows() -> list[str]:
    import tempfile
    import time

    import torch
    from torch import nn

    import toys
    from vramcut_core import Engine, EngineConfig
    from vramcut_core.figures import bandwidth
    from vramcut_core.runtime import disk

    class SleepBlock(nn.Module):
        def __init__(self, c: float) -> None:
            super().__init__()
            self.lin, self.c = nn.Linear(1024, 1024), c

        def forward(self, x):
            time.sleep(self.c)
            return self.lin(x)

    class SleepStack(nn.Module):
        def __init__(self, cs) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(SleepBlock(c) for c in cs)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    real = disk.read_into

    def throttled(dest, reads):
        t0 = time.perf_counter()
        n = real(dest, reads)
        time.sleep(max(0.0, n / DISK_BPS - (time.perf_counter() - t0)))
        return n

    out = []
    import pytest
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setenv(disk.CACHE_ENV, os.path.join(tmp, "cache"))
        mp.setattr(disk, "read_into", throttled)
        mp.setattr(bandwidth, "disk_read", lambda path: {"cold_bytes_per_s": DISK_BPS, "cached_bytes_per_s": DISK_BPS,
                                                          "device": None, "source": "throttled"})
        for k, (cs, share, ram) in enumerate(DISK_ROWS):
            torch.manual_seed(k)
            model = toys.map_from_file(SleepStack(cs), tempfile.mkdtemp(dir=tmp))
            x = torch.randn(1, 1024)
            with torch.no_grad():
                ref = model(x)
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            eng = Engine(model, EngineConfig(budget_bytes=int(weights * share), device="cpu", ram_budget_bytes=ram,
                                             speed="time", bandwidth_bytes_per_s=5e9, flops_per_s=1e9))
            with torch.no_grad(), eng.session():
                for _ in range(3):
                    assert torch.equal(eng.run(model, x), ref)
                eng.reset_stats()
                for _ in range(4):
                    assert torch.equal(eng.run(model, x), ref)
            plan, t = eng.last_plan, eng.last_plan.tiers
            measured, pred = eng.steady_stats.s_per_forward, t.predicted_step_s
            out.append(f"disk, CPU  compute {'/'.join(f'{c * 1e3:.0f}' for c in sorted(set(cs)))} ms a block, "
                       f"RAM {ram >> 20:2d} MiB: measured {measured * 1e3:8.3f} ms, predicted {pred * 1e3:8.3f} ms, "
                       f"error {pred / measured - 1:+6.2%}  ({len(t.disk_units)} units read from disk, "
                       f"{len(t.in_ram)} in RAM, {len(plan.resident_units)} resident, {plan.slots} slots)")
            del eng, model
    return out


def run() -> list[str]:
    import pytest

    from sim_cuda import simulated_cuda

    out = []
    with pytest.MonkeyPatch.context() as mp, simulated_cuda(mp) as sim:
        for name, (build, args) in families().items():
            for _, bps in LINKS:
                out.append(family_row(sim, name, build, args, bps))
        out += random_rows(sim)
        if sim.hazards:
            out.append(f"HAZARDS: {sim.hazards[:3]}")
    return out + disk_rows()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", action="store_true", help="rewrite the generated section of docs/measurements.md")
    a = ap.parse_args(argv)
    text = run()
    print("\n".join(text))
    if a.doc:
        import docgen
        docgen.write_section(os.path.join(ROOT, "docs", "measurements.md"), "bench/bench_schedule.py",
                             "```\n" + "\n".join(text) + "\n```\n\n" + docgen.stamp("python bench/bench_schedule.py --doc"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
