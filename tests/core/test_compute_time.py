"""Compute time per unit before any run: the dry run counts each unit's FLOPs with torch's
``FlopCounterMode`` (equal to the analytic count of a Linear, an attention block written out and
one through ``scaled_dot_product_attention``, a looped unit once per pass), the units' counts add
up to the plain forward's, and a unit's seconds are its FLOPs over the matrix-product throughput
measured (once, then cached) on this machine."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from toys import assert_unchanged, seeded, snapshot
from vramcut_core import PlanUnit, find_units
from vramcut_core.figures import bandwidth
from vramcut_core.planning.timeline import unit_seconds, with_compute_times
from vramcut_core.figures.trace import trace_units

B, N, D, H = 2, 12, 32, 4  # batch, tokens, width, heads


class Attention(nn.Module):
    """Attention written out: two batched products between the projections."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, H, d // H).permute(2, 0, 3, 1, 4)
        if self.fused:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            a = ((q @ k.transpose(-1, -2)) * (d // H) ** -0.5).softmax(-1) @ v
        return x + self.out(a.transpose(1, 2).reshape(b, n, d))


class Stack(nn.Module):
    def __init__(self, fused: bool = False, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList(Attention(fused) for _ in range(depth))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def linear_flops(rows: int, fan_in: int, fan_out: int) -> int:
    return 2 * rows * fan_in * fan_out  # one multiply and one add per weight per row


def attention_flops() -> int:
    rows, dh = B * N, D // H
    return (linear_flops(rows, D, 3 * D)      # qkv
            + 2 * B * H * N * N * dh          # q @ k^T
            + 2 * B * H * N * N * dh          # scores @ v
            + linear_flops(rows, D, D))       # out


def _trace(model, *args):
    units = find_units(model).units
    tr = trace_units(model, units, model, args)
    assert tr.measurements is not None, tr.reason
    return {n: m.flops for n, m in tr.measurements.items()}


@pytest.mark.parametrize("fused", [False, True], ids=["written_out", "sdpa"])
def test_each_unit_counts_its_analytic_flops(fused):
    model = seeded(Stack(fused))
    x = torch.randn(B, N, 8)
    snap = snapshot(model)
    flops = _trace(model, x)
    assert_unchanged(model, snap)
    blocks = {n: f for n, f in flops.items() if n.startswith("blocks.")}
    assert list(blocks) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert all(f == attention_flops() for f in blocks.values()), (blocks, attention_flops())
    others = {n: f for n, f in flops.items() if n not in blocks}
    assert sorted(others.values()) == sorted([linear_flops(B * N, 8, D), linear_flops(B * N, D, 4)])


def test_the_units_add_up_to_the_plain_forwards_count():
    model = seeded(Stack(fused=False, depth=6))  # products torch counts on every device
    x = torch.randn(B, N, 8)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(x)
    assert sum(_trace(model, x).values()) == fc.get_total_flops() > 0


class Looped(nn.Module):
    """Runs its blocks once per frame, as a video VAE's decoder does."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, z):
        out = []
        for f in range(z.shape[1]):
            h = z[:, f]
            for b in self.blocks:
                h = b(h)
            out.append(h)
        return torch.stack(out, 1)


def test_a_looped_unit_counts_every_pass():
    frames = 5
    flops = _trace(seeded(Looped()), torch.randn(B, frames, D))
    assert flops == {f"blocks.{i}": frames * linear_flops(B, D, D) for i in range(4)}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(bandwidth.CACHE_ENV, str(tmp_path))
    bandwidth.forget()
    yield tmp_path
    bandwidth.forget()


def test_the_matmul_probe_is_measured_once_per_dtype_then_cached(cache_dir):
    first = bandwidth.matmul_throughput("cpu", torch.float32)
    assert first["source"] == "measured" and first["dtype"] == "float32" and first["flops_per_s"] > 0
    stored = json.loads((cache_dir / bandwidth.CACHE_FILE).read_text())
    assert stored["matmul:cpu:float32"]["flops_per_s"] == pytest.approx(first["flops_per_s"])
    assert bandwidth.matmul_throughput("cpu", torch.float32)["source"] == "memory"
    bandwidth.forget()  # a new process: the file answers
    assert bandwidth.matmul_throughput("cpu", torch.float32)["source"] == "cache"
    assert bandwidth.host_to_device("cpu")["source"] == "measured"  # the two figures do not mix
    assert bandwidth.matmul_throughput("cpu", torch.bfloat16)["source"] == "measured"


def test_the_probe_is_operations_over_seconds():
    fps = bandwidth.measure_matmul("cpu", torch.float32, n=128, repeats=2)
    assert 1e6 < fps < 1e15  # a rate: between a MFLOP/s and a PFLOP/s


def test_a_units_seconds_are_its_flops_over_the_probe(cache_dir):
    model = seeded(Stack(fused=True))
    flops = _trace(model, torch.randn(B, N, 8))
    probe = bandwidth.matmul_throughput("cpu", torch.float32)["flops_per_s"]
    units = [PlanUnit(n, 1000) for n in flops] + [PlanUnit("never_run", 1000, entered=False)]
    timed = with_compute_times(units, flops, probe)
    for u in timed[:-1]:
        assert u.compute_s == flops[u.name] / probe == unit_seconds(flops[u.name], probe)
    assert timed[-1].compute_s is None  # no count: no time
    assert unit_seconds(flops["blocks.0"], None) is None  # no probe: no time


def test_a_unit_cut_finer_keeps_its_parts_flops_summed():
    # planner.aggregate folds the parts of a finer cut back into the unit they were cut from: its
    # FLOPs are the parts' sum, and unknown when one part's count is not known
    from vramcut_core.engine import EngineConfig
    from vramcut_core.figures.meters import UnitMeasurement
    from vramcut_core.planning.planner import UnitPlanner

    model = seeded(Stack(fused=False))
    planner = UnitPlanner(model, EngineConfig(budget_bytes=1 << 30, device="cpu"), unit_bytes=lambda n: 1)
    parts = [p.name for p in planner.split("blocks.1", None)]
    assert len(parts) >= 2
    meas = {"embed": UnitMeasurement(10, 20, flops=5), "blocks.0": UnitMeasurement(10, 20, flops=7)}
    meas.update({p: UnitMeasurement(10, 30 + k, flops=100 * (k + 1)) for k, p in enumerate(parts)})
    out = planner.aggregate(meas)
    assert list(out) == ["embed", "blocks.0", "blocks.1"]
    assert out["blocks.1"].flops == sum(100 * (k + 1) for k in range(len(parts)))
    assert (out["embed"].flops, out["blocks.0"].flops) == (5, 7)
    meas[parts[-1]] = UnitMeasurement(10, 30, flops=None)
    assert planner.aggregate(meas)["blocks.1"].flops is None
