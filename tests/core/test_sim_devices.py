"""A model on the second GPU (``cuda:1``) while the current device is the first, on a simulated
accelerator with two devices.

Every stream, event, memory statistic and cache call the executor makes must be for its own
device: the simulator records each call that names no device (it resolves to the current one)
and which device it resolved to. The executor's buffers and the forward's activations must land
on ``cuda:1`` (the first device's allocator untouched), outputs bit-equal, peak within budget.
"""
import pytest
import torch

from sim_cuda import simulated_cuda
from test_executor import ids
from test_sim_cuda import budget_for, reserved_peak_within
from toys import FluxLike, TransformerStack, seeded
from vramcut_core import Engine, EngineConfig


@pytest.fixture
def sim2(monkeypatch):
    with simulated_cuda(monkeypatch, devices=2) as s:
        yield s
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


def run_on(sim, build, inputs, device, n=4):
    with sim.host_memory(), torch.no_grad():
        model = build()
        args = inputs()
        ref = model(*args)
    with torch.no_grad():
        with torch.cuda.device(1):   # the budget is probed on cuda:1 too
            budget = budget_for(model, *args)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device=device))
        for a in sim.allocs.values():
            a.empty_cache()
            a.reset_peak()
        sim.device_calls.clear()
        with eng.session():
            outs = [eng.run(model, *args) for _ in range(n)]
        assert eng.last_plan.streamed_bytes_per_forward > 0
    return outs, ref, budget, eng


@pytest.mark.parametrize("build,inputs", [
    (lambda: seeded(TransformerStack()), lambda: (ids(),)),
    (lambda: seeded(FluxLike(d=48)), lambda: (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)),
                                             torch.rand(2, generator=torch.Generator().manual_seed(4)))),
], ids=["transformer", "flux"])
def test_model_on_the_second_gpu_uses_only_that_device(sim2, build, inputs):
    outs, ref, budget, eng = run_on(sim2, build, inputs, "cuda:1")
    assert all(torch.equal(o, ref) for o in outs)
    wrong = [c for c in sim2.device_calls if c[1] != 1]
    assert not wrong, f"calls that resolved to the current device, not the executor's cuda:1: {sorted(set(wrong))}"
    assert sim2.allocs[0].max_allocated == 0, "the first device's allocator was used"
    assert sim2.allocs[1].max_allocated > 0
    assert sim2.allocs[1].max_reserved <= budget + 16 * sim2.allocs[1].at_peak_blocks + \
        sum(o.untyped_storage().nbytes() for o in outs)


def test_sim_catches_events_recorded_on_the_current_device(sim2):
    """Timing events of one device cannot time another's: the simulator raises as CUDA does."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(torch.cuda.current_stream(0))
    b.record(torch.cuda.current_stream(1))
    with pytest.raises(RuntimeError, match="different devices"):
        a.elapsed_time(b)
