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
each streamed or resident, one or two slots, in a session or not, three link speeds): the worst
error of the steady call and of a session's first call over ``RANDOM`` random plans. Not a GPU:
it checks the model against the executor's schedule, not against a device.
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
    n_first = 0
    for _ in range(RANDOM):
        err, first, _ = tp.random_errors(sim, rng)
        worst = max(worst, err)
        if first is not None:
            n_first += 1
            worst_first = max(worst_first, first)
    return [f"{RANDOM} random plans (4-8 blocks, each streamed or resident, 1 or 2 slots, 3 link speeds, "
            f"{n_first} in a session): steady call worst |error| {worst:.3%}, first call of a session "
            f"worst |error| {worst_first:.3%}"]


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
    return out


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
