"""The lower bound on the step any residency can reach under the timeline model
(vramcut_core.planning.bound): never above the true optimum on random models small enough to try
every residency at every slot size that changes the plan, the plan's stated gap holding its time
within that of the bound, and the bound carried on the plan's time figures and its JSON."""
from __future__ import annotations

import random

import pytest

from vramcut_core import PlanOptions, PlanUnit, build_plan
from vramcut_core.planning.bound import lower_bound
from vramcut_core.planning.plan import PlanTime
from vramcut_core.planning.residency import _Search, by_time, step_time

MB = 1 << 20


def _optimum(units, budget, bw, overlap, prefetch):
    """The fastest step over every residency of the units free to stream, each with every slot
    count the options allow and every slot size at which the streamed units merge differently (the
    largest streamed unit and each sum of a run of adjacent streamed units, up to the room): the
    true optimum under the model (``_Search.window_time`` is held equal to ``predict``)."""
    opts = PlanOptions(prefetch=prefetch)
    count = build_plan(units, budget, opts)
    s = _Search(count, bw, opts, overlap, True)
    best, n = None, len(s.free)
    for mask in range(1 << n):
        res = s.must | frozenset(s.free[k] for k in range(n) if mask >> k & 1)
        spare = s.budget - sum(s.w[i] for i in res) - s.act
        out = [i for i in s.free if i not in res]
        base = max((s.w[i] for i in out), default=0)
        windows = [(0, 0)] if not base and spare >= 0 else []
        if base:
            runs = set()
            for a in range(len(out)):
                acc = 0
                for b in range(a, len(out)):
                    if b > a and out[b] != out[b - 1] + 1:
                        break
                    acc += s.w[out[b]]
                    runs.add(acc)
            windows = [(k, size) for k in ((2, 1) if prefetch else (1,)) for size in {base, *runs}
                       if base <= size <= spare // k]
        for k, size in windows:
            t = s.window_time(res, k, size)[0]
            best = t if best is None or t < best else best
    return count, best


def _case(rnd, n):
    units = [PlanUnit(f"u{i}", int(rnd.choice([1, 2, 4, 8, 16, 30]) * 1e6 * rnd.uniform(0.75, 1.25)),
                      compute_s=rnd.choice([0.5, 1, 2, 4, 10]) * 1e-3 * rnd.uniform(0.75, 1.25),
                      calls=2 if rnd.random() < 0.1 else 1, keep_resident=i == 0 and rnd.random() < 0.2)
             for i in range(n)]
    lo, total = max(u.weight_bytes for u in units), sum(u.weight_bytes for u in units)
    return units, int(lo + rnd.random() * (total - lo)) + 1


@pytest.mark.parametrize("sizes, cases", [((8, 10), 30), ((13, 13), 2)], ids=["8-10_units", "13_units"])
def test_the_bound_is_never_above_the_fastest_residency(sizes, cases):
    rnd = random.Random(40 + sizes[0])
    done = 0
    while done < cases:
        units, budget = _case(rnd, rnd.randint(*sizes))
        bw, overlap, prefetch = rnd.choice([1e9, 3e9, 1e10]), rnd.random() < 0.8, rnd.random() < 0.8
        try:
            count, best = _optimum(units, budget, bw, overlap, prefetch)
        except Exception:
            continue  # nothing fits
        if best is None or not count.streamed_order:
            continue
        done += 1
        bound = lower_bound(units, budget, bw, count.measured, overlap)
        assert bound <= best * (1 + 1e-9), (bound, best)
        # the search's answer is at most its gap from the bound (so from the optimum)
        timed = step_time(by_time(count, bw, PlanOptions(prefetch=prefetch), overlap=overlap), bw, overlap)
        time = PlanTime(timed, 0.0, "flops", bound)
        assert best <= timed * (1 + 1e-9) and timed <= bound * (1 + time.gap) * (1 + 1e-12)


def test_the_bound_is_the_compute_where_everything_fits_and_the_copies_where_they_dominate():
    units = [PlanUnit(f"u{i}", 100 * MB, compute_s=0.001) for i in range(6)]
    assert lower_bound(units, 600 * MB, 1e9) == pytest.approx(0.006)
    # 300 MB at most stay resident beside one 100 MB slot (none smaller): 300 MB are copied per
    # step, far above the compute
    assert lower_bound(units, 400 * MB, 1e9) == pytest.approx(300 * MB / 1e9)
    # on CPU (copies do not overlap): the compute plus those copies
    assert lower_bound(units, 400 * MB, 1e9, overlap=False) == pytest.approx(0.006 + 300 * MB / 1e9)
    assert lower_bound([PlanUnit("a", MB)], 2 * MB, 1e9) is None  # no compute time


def test_the_plan_carries_its_bound_and_gap_in_its_json():
    from vramcut_core.planning.report import time_to_json

    units = [PlanUnit(f"u{i}", 100 * MB, compute_s=0.05) for i in range(6)]
    plan = build_plan(units, 400 * MB)
    step = step_time(plan, 1e9)
    bound = lower_bound(units, 400 * MB, 1e9, plan.measured)
    import dataclasses

    tj = time_to_json(dataclasses.replace(plan, time=PlanTime(step, 0.3, "flops", bound)))
    assert tj["bound_s"] == bound and tj["gap"] == pytest.approx(step / bound - 1)
