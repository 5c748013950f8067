"""Host syncs and ``empty_cache`` calls per steady forward when input shapes alternate (CFG's
cond and uncond, two batch sizes), on the simulated accelerator (tests/sim_cuda.py), so it runs
without a GPU. Two cases: both shapes plan the same buffers ("same"), or the second shape's
larger activations plan fewer residents and one slot ("reshaped"). Prints one line per case.

    python bench/bench_switch.py [--steps N] [--json | --doc]

``--doc`` rewrites the generated section of docs/measurements.md (with the stamp: bench/docgen.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "core")):
    if p not in sys.path:
        sys.path.insert(0, p)

import pytest  # noqa: E402  (its MonkeyPatch installs the simulator)

import test_sim_switch  # noqa: E402
from sim_cuda import simulated_cuda  # noqa: E402


def run(kind: str, steps: int) -> dict:
    test_sim_switch.STEPS = steps
    mp = pytest.MonkeyPatch()
    try:
        with simulated_cuda(mp) as sim:
            (syncs, caches), exact, (pa, pb), over = test_sim_switch.alternate(sim, kind)
            hazards = len(sim.hazards)
    finally:
        mp.undo()
    return {"case": kind, "steps": steps, "host_syncs_per_forward": syncs, "empty_cache_per_forward": caches,
            "bit_equal": exact, "hazards": hazards, "reserved_within_budget": over is None, "same_plan": pa is pb,
            "plans": [{"resident": len(p.resident_units), "slots": p.slots, "slot_bytes": p.slot_bytes} for p in (pa, pb)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="alternating forwards after warm-up")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--doc", action="store_true", help="rewrite the generated section of docs/measurements.md")
    a = ap.parse_args(argv)
    rows = [run(k, a.steps) for k in ("same", "reshaped")]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    lines = [f"{r['case']:9s} {r['steps']} alternating forwards: {r['host_syncs_per_forward']:.2f} host syncs, "
             f"{r['empty_cache_per_forward']:.2f} empty_cache per forward; bit-equal {r['bit_equal']}, "
             f"hazards {r['hazards']}, reserved within budget {r['reserved_within_budget']}, "
             f"one plan for both shapes {r['same_plan']}" for r in rows]
    if a.doc:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import docgen
        cmd = "python bench/bench_switch.py --doc" + (f" --steps {a.steps}" if a.steps != 10 else "")
        docgen.write_section(os.path.join(ROOT, "docs", "measurements.md"), "bench/bench_switch.py",
                             "```\n" + "\n".join(lines) + "\n```\n\n" + docgen.stamp(cmd))
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
