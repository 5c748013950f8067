"""The executor's fixed cost per forward: hooks installed and removed, units entered, pointers
swapped, measured on a model shaped like Flux (19 double + 38 single blocks, about 900 modules
that own weights) but with tiny weights, so compute and copies are negligible and what remains
is the bookkeeping. Run: python bench/bench_overhead.py"""
from __future__ import annotations

import sys
import time

import torch
from torch import nn

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


def best(fn, n=30):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main() -> int:
    torch.set_num_threads(1)
    m = FluxShaped().eval()
    x = torch.randn(1, 8)
    owners = sum(1 for mod in m.modules() if any(True for _ in mod.parameters(recurse=False)))
    us = find_units(m)
    with torch.inference_mode():
        plain = best(lambda: m(x))
        results = {}
        for label, share in (("all resident", 10.0), ("all streamed", 0.0)):
            budget = int(us.weight_bytes * share) + (1 << 20) if share else 3 * max(u.weight_bytes for u in us.units) + (1 << 20)
            eng = Engine(m, EngineConfig(budget_bytes=budget, device="cpu", residency=share > 0))
            with eng.session():
                eng.run(m, x)
                results[label] = best(lambda: eng.run(m, x))
    print(f"{len(us)} units, {owners} modules owning weights")
    print(f"plain forward                 {plain * 1e3:7.2f} ms")
    for k, v in results.items():
        print(f"VRAMCut, {k:20s} {v * 1e3:7.2f} ms  (+{(v - plain) * 1e3:.2f} ms per forward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
