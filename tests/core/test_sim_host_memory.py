"""Host memory on the CUDA branch (simulated accelerator): page-locked staging buffers are
counted in the page-locked report, and no copy from pageable memory is issued as non-blocking
(CUDA stages it and the host stalls anyway, silently): pageable sources are copied synchronously,
on purpose, or through page-locked memory."""
import pytest
import torch

from test_executor import ids
from test_sim_cuda import budget_for, cuda_engine, sim  # noqa: F401
from toys import TransformerStack, seeded
from vramcut_core.runtime import host_memory as ex


def model_and_ref(sim):
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        return model, x, model(x)


def test_staging_buffers_are_counted_as_page_locked(sim, monkeypatch):
    """Registration fails (the host's pinned limit): masters stay pageable and are copied through
    page-locked staging buffers from torch's host allocator, which keeps them cached. Those
    bytes are page-locked memory the pack uses: the report (and the room left to the host's own
    limit) must count them."""
    model, x, ref = model_and_ref(sim)
    with torch.no_grad():
        budget = budget_for(model, x)
        for m in list(ex._SHARED_MASTERS.values()):
            m.release()
        ex._SHARED_MASTERS.clear()
        monkeypatch.setattr(ex.PAGE_LOCKED, "bytes", 0)      # the ledger is the process's: start it here
        monkeypatch.setattr(ex.PAGE_LOCKED, "staging", 0)
        monkeypatch.setattr(ex.PAGE_LOCKED, "_in_flight", [])
        sim.register_error = lambda ptr, size: 2
        sim.pinned_peak = 0
        eng = cuda_engine(model, budget)
        with eng.session():
            outs = [eng.run(model, x) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    assert sim.pinned_peak > 0, "the scenario needs staging"
    assert ex.PAGE_LOCKED.bytes >= sim.pinned_peak, \
        f"{sim.pinned_peak} B of page-locked staging, {ex.PAGE_LOCKED.bytes} B reported"


@pytest.mark.parametrize("pin", [False, True], ids=["pin_memory_off", "pin_memory_on"])
def test_no_async_copy_from_pageable_memory(sim, pin):
    model, x, ref = model_and_ref(sim)
    with torch.no_grad():
        budget = budget_for(model, x)
        for m in list(ex._SHARED_MASTERS.values()):   # the probe's: the weights pageable again
            m.release()
        ex._SHARED_MASTERS.clear()
        eng = cuda_engine(model, budget, pin_memory=pin)
        with eng.session():
            outs = [eng.run(model, x) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    assert not sim.pageable_async, f"non-blocking copies from pageable memory: {sim.pageable_async[:3]}"
