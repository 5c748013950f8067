"""The executor's fixed cost per forward: hooks installed and removed, units entered, pointers
swapped, measured on a model shaped like Flux (19 double + 38 single blocks, 629 modules that
own weights) but with tiny weights, so compute and copies are negligible and what remains
is the bookkeeping. Run: python bench/bench_overhead.py [--rounds N --calls N]"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's engine
from vramcut_core import Engine, EngineConfig, find_units


class Block(nn.Module):
    def __init__(self, d: int, n_linear: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.ModuleList(nn.Linear(d, d) for _ in range(n_linear))

    def forward(self, x):
        x = self.norm(x)
        for l in self.lin:
            x = l(x)
        return x


class FluxShaped(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.img_in = nn.Linear(d, d)
        self.double_blocks = nn.ModuleList(Block(d, 20) for _ in range(19))
        self.single_blocks = nn.ModuleList(Block(d, 5) for _ in range(38))
        self.final_layer = nn.Linear(d, d)

    def forward(self, x):
        x = self.img_in(x)
        for b in self.double_blocks:
            x = b(x)
        for b in self.single_blocks:
            x = b(x)
        return self.final_layer(x)


def timed(fn, n: int) -> float:
    """Seconds per call of ``fn``: the fastest of ``n`` calls."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def hooks_on(m: nn.Module) -> int:
    return sum(len(mod._forward_pre_hooks) for mod in m.modules())


def main() -> int:
    """Rounds interleave the plain forward with each VRAMCut configuration (a shared, noisy host
    slows all of them alike); each round keeps the fastest of ``--calls`` forwards per row, and
    the figures printed are medians over ``--rounds`` rounds."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = FluxShaped().eval()
    x = torch.randn(1, 8)
    owners = sum(1 for mod in m.modules() if any(True for _ in mod.parameters(recurse=False)))
    us = find_units(m)
    engines = {}
    for label, share in (("all resident", 10.0), ("all streamed", 0.0)):
        budget = int(us.weight_bytes * share) + (1 << 20) if share else 3 * max(u.weight_bytes for u in us.units) + (1 << 20)
        engines[label] = Engine(m, EngineConfig(budget_bytes=budget, device="cpu", residency=share > 0))
    rows: dict[str, list[float]] = {"plain": [], **{k: [] for k in engines}, "no-op": []}
    noop = lambda x: None  # noqa: E731  (the engine's own work per call: no module runs)
    hooks: dict[str, int] = {}
    with torch.inference_mode():
        for _ in range(a.rounds):
            rows["plain"].append(timed(lambda: m(x), a.calls))
            for label, eng in engines.items():
                with eng.session():
                    eng.run(m, x)  # the measured forward (first round), or the session's first
                    eng.run(m, x)
                    rows[label].append(timed(lambda: eng.run(m, x), a.calls))
                    hooks[label] = hooks_on(m)
                    if label == "all resident":
                        rows["no-op"].append(timed(lambda: eng.run(noop, x), a.calls))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{len(us)} units, {owners} modules owning weights; medians of {a.rounds} rounds, "
          f"each the fastest of {a.calls} forwards")
    print(f"plain forward                 {med['plain'] * 1e3:7.2f} ms")
    for k in engines:
        d = [r - p for r, p in zip(rows[k], rows["plain"])]
        plan = engines[k].last_plan
        print(f"VRAMCut, {k:20s} {med[k] * 1e3:7.2f} ms  (+{statistics.median(d) * 1e3:.2f} ms per forward; "
              f"{hooks[k]} forward pre-hooks on the module; {plan.transfers_per_forward} transfers per forward)")
    print(f"VRAMCut, all resident, the forward replaced by a no-op: {med['no-op'] * 1e3:.3f} ms per call "
          f"(the engine's own work)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
