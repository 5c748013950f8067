"""Giving device memory back on the simulated accelerator: a released session leaves nothing
reserved (the caching allocator's blocks go back, for other programs and the host's next model).
``test_sim_catches_*`` takes the ``empty_cache`` out and shows the check fails.
"""
import torch

from test_sim_cuda import budget_for, cuda_engine, fresh_peak, sim  # noqa: F401
from toys import FluxLike, seeded
from vramcut_core.runtime import device_memory


def _flux_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 5, 16, generator=g), torch.rand(2, generator=g)


def reserved_after_release(sim) -> tuple[int, int]:
    """Reserved bytes before a session and after it ends (its buffers released)."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(FluxLike(d=48))
        a = _flux_inputs()
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, *a))
        base = fresh_peak(sim)
        with eng.session():
            eng.run(model, *a)
            eng.run(model, *a)
            assert sim.alloc.reserved > base
        return base, sim.alloc.reserved


def test_freed_buffers_stay_reserved_lost_to_other_programs(sim):
    base, after = reserved_after_release(sim)
    assert after == base, f"{after - base} B still reserved after the session released its buffers"


def test_sim_catches_freed_buffers_kept_reserved(sim, monkeypatch):
    clear = device_memory.DeviceMemory.clear

    def clear_keeping_the_cache(self):
        monkeypatch.setattr(self, "empty_cache", lambda: None, raising=False)
        clear(self)

    monkeypatch.setattr(device_memory.DeviceMemory, "clear", clear_keeping_the_cache)
    base, after = reserved_after_release(sim)
    assert after > base
