"""The measuring forward on CUDA never peaks above the budget (simulated accelerator).

Between module calls the executor sees live bytes; a temporary made and freed inside one
module's forward (an attention score matrix, an upcast) it cannot see there. While a measuring
forward runs, the caching allocator is capped at the budget, so such an overshoot is an
out-of-memory error at the allocation, turned into ``OverBudget`` and a finer cut: the reserved
peak stays within the budget on every forward, the first (measuring) ones included.
"""
import gc

import pytest
import torch

from test_sim_cuda import cuda_engine, fresh_peak, probe_plan, reserved_peak_within, sim  # noqa: F401
from toys import TempStack, seeded


@pytest.mark.parametrize("figures", [{}, {"flops_per_s": 5.5e9, "bandwidth_bytes_per_s": 2e9}],
                         ids=["probed", "known_rates"])
def test_measuring_forward_with_an_intra_module_temporary_stays_within_budget(sim, figures):
    """``known_rates``: the bandwidth and throughput known before the first forward (given, or
    cached by an earlier run), so the finer cut shares the unit's compute time among its parts
    (which asked the parts' bytes before the parts were known: a KeyError)."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(TempStack())
        x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2))
        ref = model(x)
    with torch.no_grad():
        probe = probe_plan(model, x)
        block = max(u.weight_bytes for u in probe.units)
        act = probe.activation_reserve_bytes
        # the measuring forward's one slot of a block beside the temporary does not fit; two
        # slots of a third of a block (its linear layers) do
        budget = act + (block + 2 * block // 3) // 2
        assert block + act > budget, "the scenario needs an overshoot at the block cut"
        eng = cuda_engine(model, budget, **figures)
        base = fresh_peak(sim)
        outs = []
        with eng.session():
            for _ in range(4):
                outs.append(eng.run(model, x))
        assert all(torch.equal(o, ref) for o in outs)
        assert eng.last_plan.split, "the overshoot must become a finer cut"
        reserved_peak_within(sim, budget, base, held=outs)
    assert all(a.cap is None for a in sim.allocs.values()), "the cap must be lifted after measuring"
    del eng
    gc.collect()   # the executors go while this simulator runs (their masters are unpinned here)
