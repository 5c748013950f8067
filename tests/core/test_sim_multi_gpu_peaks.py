"""Activations counted on the device that holds them, across simulated GPUs.

A UNet keeps its skip connections outside its blocks: with the home rule they, and the tensors a
unit's inputs were moved from, stay on the home device while the output blocks compute on another.
A unit measured on cuda:1 sees only what cuda:1 holds; a placement that keeps cuda:0 busy with its
own units and forgets what the others leave there runs cuda:0 over its budget on every forward
(and measuring again places the same way). The home device's part holds, beside its own units'
activations, the most any other unit leaves there (``placement.place``'s ``held``): every forward's
per-device peak, measured by the engine and reserved in the simulator's allocator, stays within
that device's budget, and the output is the unpatched model's.
"""
from __future__ import annotations

import gc
import logging

import pytest
import torch

from sim_cuda import simulated_cuda
from toys import UNetLike, seeded
from vramcut_core import Engine, EngineConfig, find_units


@pytest.fixture
def sim2(monkeypatch):
    with simulated_cuda(monkeypatch, devices=2) as s:
        yield s
        gc.collect()
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


@pytest.mark.parametrize("shares", [(1.0, 1.2), (1.05, 1.3)], ids=["1.0-1.2", "1.05-1.3"])
def test_a_unets_skips_count_on_the_home_device_every_forward_within_each_budget(sim2, shares, caplog):
    sim = sim2
    with sim.host_memory(), torch.no_grad():
        model = seeded(UNetLike(ch=32, levels=3))
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randn(1, 4, 16, 16, generator=g), torch.rand(1, generator=g))
        ref = model(*inputs)
    args = tuple(a.clone() for a in inputs)   # made outside host memory: cuda:0's
    w = find_units(model).weight_bytes
    devs = [("cuda:0", int(w * shares[0])), ("cuda:1", int(w * shares[1]))]
    eng = Engine(model, EngineConfig(budget_bytes=sum(b for _, b in devs), device="cuda:0", devices=tuple(devs)))
    over = []
    with torch.no_grad(), eng.session(), caplog.at_level(logging.WARNING, logger="vramcut"):
        for f in range(1, 6):
            for a in sim.allocs.values():
                a.reset_peak()
            bases = {i: a.reserved for i, a in sim.allocs.items()}
            assert torch.equal(eng.run(model, *args), ref), f"forward {f} differs from the unpatched model"
            for i, (d, b) in enumerate(devs):
                measured = eng.last_device_stats[d].peak_device_bytes if d in eng.last_device_stats else 0
                reserved = sim.allocs[i].max_reserved - bases[i]
                if measured > b or reserved > b:
                    over.append((f, d, measured, reserved, b))
    assert not over, f"(forward, device, measured peak, reserved peak, budget) over a budget: {over}"
    assert not [r for r in caplog.records if "above its budget" in r.getMessage()]
    assert {d.device for d in eng.placement.used} == {"cuda:0", "cuda:1"}, "both devices take units"
    assert eng.describe()["plan"]["hop_rule"] == "home"
