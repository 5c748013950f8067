"""The probes (``figures.bandwidth``: the copy and the matrix product) run inside the budget on the
simulated accelerator: sized to what the budget leaves when they run (nothing where it leaves too
little), so every forward's reserved peak, the first included, stays within the budget; a dtype
no matrix product runs in allocates nothing; the copy probe fits a fixed cost per copy."""
from __future__ import annotations

import pytest
import torch

from sim_cuda import flop_seconds
from test_sim_cuda import fresh_peak, reserved_peak_within, sim  # noqa: F401  (the fixture)
from test_sim_timing import build
from timed_plans import Block
from vramcut_core import Engine, EngineConfig
from vramcut_core.figures import bandwidth
from vramcut_core.model.tensors import MIB


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(bandwidth.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "simulated")
    bandwidth.forget()
    yield tmp_path
    bandwidth.forget()


def forwards_within(sim, model, x, ref, budget: int, calls: int = 3) -> Engine:
    """An engine choosing residency by time with no figure given (the matmul probe runs while it
    plans), ``calls`` forwards in a session, each one's reserved peak within ``budget``."""
    eng = Engine(model, EngineConfig(budget_bytes=budget, device="cuda", speed="time"))
    with torch.no_grad(), eng.session():
        for _ in range(calls):
            base = fresh_peak(sim) - eng.held_bytes
            assert torch.equal(eng.run(model, x), ref)
            reserved_peak_within(sim, budget, base)
    return eng


@pytest.mark.parametrize("room", [0, 36 * MIB], ids=["tiny", "room"])
def test_the_probes_stay_within_the_budget_of_every_forward(sim, cache_dir, room):
    """Half the weights (the matmul probe's full 192 MiB would pass it 700 times), then that plus
    36 MiB (the probe's matrices sized down to fit beside the weights held)."""
    model, x, ref = build(sim, [Block(256) for _ in range(6)])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    eng = forwards_within(sim, model, x, ref, weights // 2 + room)
    fps = bandwidth.matmul_throughput("cuda", torch.float32, max_bytes=eng.probe_room_bytes)
    if not room:
        assert fps["source"] == bandwidth.NO_ROOM and fps["flops_per_s"] is None
        assert eng.last_plan.time is None, "no throughput: no compute times, the count-based plan"
    else:
        assert fps["source"] == "memory" and fps["flops_per_s"] > 0
    # the node's answer line measures the copy the same way, inside what the budget leaves
    bw = bandwidth.host_to_device("cuda", max_bytes=eng.probe_room_bytes)
    fresh_peak(sim)
    if eng.probe_room_bytes < bandwidth.MIN_PROBE_BYTES:
        assert bw["source"] == bandwidth.NO_ROOM
    else:
        assert bw["source"] == "measured" and bw["bytes_per_s"] > 0


def test_a_dtype_no_product_runs_in_allocates_nothing(sim, cache_dir):
    before = sim.alloc.high_allocated
    got = bandwidth.matmul_throughput("cuda", torch.float8_e4m3fn)
    assert got["flops_per_s"] is None and got["source"] == "unmeasurable"
    assert sim.alloc.high_allocated == before


def test_the_copy_probe_fits_the_fixed_cost_of_a_copy(sim, cache_dir):
    sim.set_durations(copy_bytes_per_s=2e9, op_seconds=flop_seconds(1e12), copy_latency_s=5e-4)
    bps, lat = bandwidth.fit_copy("cuda", 16 * MIB)
    assert bps == pytest.approx(2e9, rel=1e-6) and lat == pytest.approx(5e-4, rel=1e-6)
    got = bandwidth.host_to_device("cuda")
    assert got["latency_s"] == pytest.approx(5e-4, rel=1e-6)
    bandwidth.forget()  # a new process: the file has both
    assert bandwidth.cached_latency("cuda") == pytest.approx(5e-4, rel=1e-6)
