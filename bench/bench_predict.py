"""The timeline model against the executor on CPU: predicted time per call vs measured, per family.

    OMP_NUM_THREADS=1 python bench/bench_predict.py [--repeat N] [--doc]

On CPU a copy is a memory copy on the thread that computes, so the model runs without overlap
(``timeline.predict(plan, bytes_per_s, overlap=False)``): a call is its units' compute plus every
streamed segment's whole copy. The tiny families of the engine's tests (tests/core/toys.py: a
transformer stack, a Flux-like double/single stack, a UNet with skip connections), seeded and
sized so a call takes milliseconds, run under the smallest budget for their shape plus half their
weights, in one session (slots kept between calls, as a sampling run keeps them). Compute per unit,
three ways: (i) the engine's own unit clock (``speed.UnitTimes``: on CPU the call after the
measuring one is timed unit by unit, wall time without the meter); (ii) the dry run's FLOPs
(``UnitMeasurement.flops``) over the matrix-product throughput (``bandwidth.matmul_throughput``);
(iii) the plain model's measured call spread over the units by FLOPs (how docs/predicted.md uses
a published time). Copy = streamed bytes / the host-to-device copy rate (``bandwidth``), each
rate measured on this machine by the engine's probes in a fresh cache folder. Measured: the median
of ``--repeat`` calls after the measuring and the timed call; the machine may be shared, so the
whole measurement runs ``--runs`` times (rates measured again each time) and the median of each
figure is printed, with the range of each error. The model has no term for the executor's own
cost per call (hooks, binding) or per copy; the line per family shows what is left for it.
``--doc`` rewrites the generated section of
docs/measurements.md (stamped: bench/docgen.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests", "core")):
    if p not in sys.path:
        sys.path.insert(0, p)

TOLERANCE = 0.15
SHARE = 0.5  # the budget: the smallest for the shape plus this share of the weights


def families():
    """name -> (model, args): each sized so a call computes for milliseconds on one core."""
    import torch

    import toys
    g = torch.Generator().manual_seed(0)
    return {
        "transformer": (toys.seeded(toys.TransformerStack(d=256, depth=8, vocab=512)),
                        (torch.randint(0, 512, (1, 256), generator=g),)),
        "flux-like": (toys.seeded(toys.FluxLike(d=256, n_double=4, n_single=6)),
                      (torch.randn(1, 256, 16, generator=g), torch.rand(1, generator=g))),
        "unet-like": (toys.seeded(toys.UNetLike(ch=32, levels=3)),
                      (torch.randn(1, 4, 64, 64, generator=g), torch.rand(1, generator=g))),
    }


def measure(name: str, model, args, repeat: int) -> dict:
    import torch

    from vramcut_core import Engine, EngineConfig
    from vramcut_core.figures import bandwidth
    from vramcut_core.planning.timeline import predict, with_compute_times

    from vramcut_core.planning.budget import BudgetError

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    try:  # the smallest budget for this shape (activations included), as the node would ask for
        with torch.inference_mode():
            Engine(model, EngineConfig(budget_bytes=1, device="cpu")).run(model, *args)
        raise RuntimeError(f"{name}: a budget of one byte was not refused")
    except BudgetError as e:
        least = e.min_budget_bytes
    eng = Engine(model, EngineConfig(budget_bytes=least + int(weights * SHARE), device="cpu"))
    times, copy_s, compute_s = [], [], []
    with torch.inference_mode(), eng.session():
        eng.run(model, *args)  # the measuring call
        eng.run(model, *args)  # the timed call: each unit's wall time (``speed.UnitTimes``)
        for _ in range(repeat):
            t0 = time.perf_counter()
            eng.run(model, *args)
            times.append(time.perf_counter() - t0)
            copy_s.append(eng.last_stats.time_copy_s)
            compute_s.append(eng.last_stats.time_compute_s)
        plan = eng.last_plan
        unit_s = eng.shapes[eng.last_signature].times.seconds()  # the measuring call's unit clock (wall time)
    with torch.inference_mode():  # the plain model, every weight in place: the resident call
        model(*args)
        plain = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(*args)
            plain.append(time.perf_counter() - t0)
    resident = statistics.median(plain)
    tr = next(iter(eng.traces.values()))
    flops = {n: m.flops for n, m in (tr.measurements or {}).items()}
    for u in plan.units:  # a part of a finer cut: its unit's count is not split, so none
        flops.setdefault(u.name, None)
    fps = bandwidth.matmul_throughput("cpu", torch.float32)["flops_per_s"]
    bps = bandwidth.host_to_device("cpu")["bytes_per_s"]
    timed = dataclasses.replace(plan, units=tuple(with_compute_times(plan.units, flops, fps)))
    tl = predict(timed, bps, overlap=False)
    # (b) as docs/predicted.md does with a published time: the resident call measured, spread
    # over the units by FLOPs
    total = sum(f or 0 for f in flops.values())
    spread = dataclasses.replace(plan, units=tuple(with_compute_times(plan.units, flops, total / resident)))
    tl_b = predict(spread, bps, overlap=False)
    # (ii) each unit's time as the engine measured it in its measuring call (``speed.UnitTimes``)
    clocked = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, compute_s=(unit_s or {}).get(u.name))
                                                    for u in plan.units))
    tl_m = predict(clocked, bps, overlap=False)
    measured = statistics.median(times)
    return dict(family=name, resident_s=resident, predicted_m_s=tl_m.step_s, error_m=tl_m.step_s / measured - 1,
                predicted_m_compute_s=tl_m.compute_s, predicted_m_copy_s=tl_m.stall_s, predicted_b_s=tl_b.step_s, error_b=tl_b.step_s / measured - 1,
                predicted_s=tl.step_s, measured_s=measured, error=tl.step_s / measured - 1,
                predicted_compute_s=tl.compute_s, predicted_copy_s=tl.stall_s,
                measured_compute_s=statistics.median(compute_s), measured_copy_s=statistics.median(copy_s),
                streamed_bytes=plan.streamed_bytes_per_forward, transfers=plan.transfers_per_forward,
                flops=sum(f or 0 for f in flops.values()), flops_per_s=fps, bytes_per_s=bps)


def summary(runs: list[list[dict]]) -> list[dict]:
    """Per family, the median over the runs of each figure (the machine is shared: one run's
    rates move), with the smallest and largest error of each prediction."""
    out = []
    for k, first in enumerate(runs[0]):
        rs = [run[k] for run in runs]
        row = {key: (statistics.median(r[key] for r in rs) if isinstance(v, (int, float)) else v)
               for key, v in first.items()}
        for e in ("error", "error_b", "error_m"):
            row[e + "_range"] = (min(r[e] for r in rs), max(r[e] for r in rs))
        out.append(row)
    return out


def lines(rows: list[dict], runs: int) -> list[str]:
    ok = lambda e: "within" if abs(e) <= TOLERANCE else "NOT within"  # noqa: E731
    rng = lambda r, e: f"{r[e + '_range'][0] * 100:+.1f} .. {r[e + '_range'][1] * 100:+.1f} %"  # noqa: E731
    out = [f"each figure the median over {runs} runs, taken separately (a run: the median of its timed calls); "
           "error = predicted / measured - 1 in each run; the unit clock is one timed call per run"]
    for r in rows:
        out.append(f"{r['family']:12s} measured {r['measured_s'] * 1e3:7.2f} ms per call "
                   f"(units {r['predicted_m_compute_s'] * 1e3:.2f} ms by the unit clock, copies {r['measured_copy_s'] * 1e3:.2f} ms, "
                   f"the executor's own {max(0.0, r['measured_s'] - r['predicted_m_compute_s'] - r['measured_copy_s']) * 1e3:.2f} ms; "
                   f"plain model {r['resident_s'] * 1e3:.2f} ms)")
        for tag, key, e in (("(i)  measured unit times", "predicted_m_s", "error_m"),
                            ("(ii) FLOPs / probe     ", "predicted_s", "error"),
                            ("(iii) plain call spread", "predicted_b_s", "error_b")):
            out.append(f"{'':12s} {tag} predicted {r[key] * 1e3:7.2f} ms, error {r[e] * 100:+6.1f} % "
                       f"({ok(r[e])} {TOLERANCE * 100:.0f} %; runs {rng(r, e)})")
        out.append(f"{'':12s} copies predicted {r['predicted_m_copy_s'] * 1e3:.2f} ms / measured {r['measured_copy_s'] * 1e3:.2f} ms "
                   f"({r['streamed_bytes'] / 2**20:.1f} MiB in {int(r['transfers'])} transfers)")
    r = rows[0]
    out.append(f"rates measured here (median): matrix product {r['flops_per_s'] / 1e9:.1f} GFLOP/s (fp32), "
               f"copy {r['bytes_per_s'] / 1e9:.1f} GB/s")
    out.append("(i): compute per unit = the engine's unit clock in its timed call (wall time, no meter); "
               "(ii): the dry run's FLOPs / the measured matrix-product rate; (iii): the plain model's measured "
               "call spread over the units by FLOPs (how docs/predicted.md uses a published time); "
               "copies = streamed bytes / the measured copy rate, no overlap; these predictions leave out the "
               "executor's own cost per call and per copy (the model's call_s and latency_s)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15, help="timed calls per family (the median is kept)")
    ap.add_argument("--runs", type=int, default=5, help="whole runs (rates measured again each); the median is kept")
    ap.add_argument("--doc", action="store_true", help="rewrite the generated section of docs/measurements.md")
    a = ap.parse_args(argv)
    fams = families()
    runs = []
    for _ in range(a.runs):  # each run measures the rates again (a fresh cache), then each family
        os.environ["VRAMCUT_CACHE_DIR"] = tempfile.mkdtemp(prefix="vramcut-rates-")  # measured now, here
        from vramcut_core.figures import bandwidth
        bandwidth.forget()
        runs.append([measure(n, m, args, a.repeat) for n, (m, args) in fams.items()])
    text = lines(summary(runs), a.runs)
    if a.doc:
        import docgen
        threads = os.environ.get("OMP_NUM_THREADS", "unset")
        cmd = "OMP_NUM_THREADS=1 python bench/bench_predict.py --doc" + (f" --repeat {a.repeat}" if a.repeat != 15 else "") \
            + (f" --runs {a.runs}" if a.runs != 5 else "")
        docgen.write_section(os.path.join(ROOT, "docs", "measurements.md"), "bench/bench_predict.py",
                             "```\n" + "\n".join(text) + "\n```\n\n" + docgen.stamp(cmd, f"OMP_NUM_THREADS={threads}."))
    else:
        print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
