"""Alternating input shapes (CFG's cond and uncond, batch sizes) on the simulated accelerator.

A sampling step runs the model on two or more cached signatures in turn. After warm-up (each
shape measured once), a steady step, any mix of cached shapes, must not block the host (no
stream, event or device synchronize) and must not call ``empty_cache`` (a device-wide
synchronisation under ``cudaMallocAsync``, the default allocator of cu130 builds). Outputs stay
bit-equal and the reserved peak within the budget over the whole run.
"""
import gc
import weakref

import torch

from test_sim_cuda import budget_for, cuda_engine, fresh_peak, reserved_peak_within, sim  # noqa: F401
from toys import FluxLike, seeded

STEPS = 10


def shapes(kind):
    """Two input signatures: the same buffers in both plans ("same"), or the second's larger
    activations plan fewer residents and one slot ("reshaped")."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(2, 5, 16, generator=g), torch.rand(2, generator=g))
    if kind == "same":
        b = (torch.randn(1, 9, 16, generator=g), torch.rand(1, generator=g))
    else:
        b = (torch.randn(2, 40, 16, generator=g), torch.rand(2, generator=g))
    return a, b


def alternate(sim, kind):
    """Warm up on both shapes, then ``STEPS`` alternating forwards: (host syncs, empty_cache
    calls) per steady forward, whether every output was bit-equal, the two plans, and the
    reserved peak over the whole run past the budget (None: within it)."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(FluxLike(d=48))
        a, b = shapes(kind)
        refs = {0: model(*a), 1: model(*b)}
    with torch.no_grad():
        budget = budget_for(model, *a)
        eng = cuda_engine(model, budget)
        base = fresh_peak(sim)
        exact = True
        with eng.session():
            for i in range(4):                       # warm-up: each shape measured, then planned
                exact &= torch.equal(eng.run(model, *(a, b)[i % 2]), refs[i % 2])
            syncs, caches = sim.host_syncs, sim.empty_cache_calls
            for i in range(STEPS):                   # (outputs compared and dropped, as a sampler does)
                exact &= torch.equal(eng.run(model, *(a, b)[i % 2]), refs[i % 2])
            per = ((sim.host_syncs - syncs) / STEPS, (sim.empty_cache_calls - caches) / STEPS)
        plans = (eng.plan_for(a), eng.plan_for(b))
        try:
            reserved_peak_within(sim, budget, base)
            over = None
        except AssertionError as e:
            over = str(e)
    return per, exact, plans, over


def test_alternating_shapes_same_buffers_no_host_sync(sim):
    (syncs, caches), exact, _, over = alternate(sim, "same")
    assert exact
    assert over is None, over
    assert syncs == 0, f"{syncs} host syncs per steady forward"
    assert caches == 0, f"{caches} empty_cache calls per steady forward"


def test_alternating_shapes_whose_plans_differ_no_host_sync_no_empty_cache(sim):
    (syncs, caches), exact, (pa, pb), over = alternate(sim, "reshaped")
    assert exact
    assert pa is pb, "alternating shapes whose plans lay the buffers out differently share one plan"
    assert over is None, over
    assert syncs == 0, f"{syncs} host syncs per steady forward"
    assert caches == 0, f"{caches} empty_cache calls per steady forward"


def step_collecting_a_released_engine(sim):
    """Host syncs of one steady forward of an engine while another engine on the same model (run
    once, released, dropped) is collected inside it, from a block's forward hook, as Python's
    cycle collector may do at any allocation; and whether its finalizers ran there."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(FluxLike(d=48))
        a, _ = shapes("same")
    with torch.no_grad():
        budget = budget_for(model, *a)
        other = [cuda_engine(model, budget)]
        other[0].run(model, *a)
        other[0].release()
        gone = weakref.ref(other[0].executor.transfers)
        eng = cuda_engine(model, budget)
        with eng.session():
            for _ in range(2):
                eng.run(model, *a)
            collected = []

            def collect(*_):
                if other:
                    other.clear()
                    gc.collect()
                    collected.append(gone() is None)

            hook = model.double_blocks[1].register_forward_pre_hook(collect)
            try:
                before = sim.host_syncs
                eng.run(model, *a)
                syncs = sim.host_syncs - before
            finally:
                hook.remove()
    return syncs, collected


def test_a_released_engine_collected_inside_another_engines_step_does_not_sync(sim):
    syncs, collected = step_collecting_a_released_engine(sim)
    assert collected == [True], "the dropped engine's transfers were not collected inside the step"
    assert syncs == 0, f"{syncs} host syncs in a steady step that collected a released engine"


def test_an_engine_collected_with_a_copy_in_flight_waits_for_it(sim):
    """The other side of the finalizer: an engine dropped without release, its next prefetch
    still queued on the copy stream, blocks the host until that copy lands before its buffers go."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(FluxLike(d=48))
        a, _ = shapes("same")
    with torch.no_grad():
        budget = budget_for(model, *a)
        keeper = cuda_engine(model, budget)  # shares the host masters: their finalizers stay out
        keeper.run(model, *a)
        keeper.release()
        other = [cuda_engine(model, budget)]
        other[0].keep_buffers(True)
        for _ in range(3):  # measured, then planned: a planned forward ends prefetching the next
            other[0].run(model, *a)
        stream = other[0].executor.transfers.copy_stream
        assert not stream.query(), "the forward should end with the next prefetch queued"
        before = sim.host_syncs
        other.clear()
        gc.collect()
        assert stream.query() and sim.host_syncs > before
        assert not sim.hazards, sim.hazards
        del keeper


def test_joint_measurements_take_the_most_of_each_unit_and_refuse_other_units():
    from vramcut_core.figures.meters import UnitMeasurement, joint_measurements
    a = {"x": UnitMeasurement(10, 50), "y": UnitMeasurement(20, 30, calls=2)}
    b = {"x": UnitMeasurement(12, 40), "y": UnitMeasurement(5, 90)}
    j = joint_measurements([a, b])
    assert list(j) == ["x", "y"]
    assert (j["x"].entry_bytes, j["x"].peak_bytes, j["y"].peak_bytes, j["y"].calls) == (12, 50, 90, 2)
    assert joint_measurements([a, {"y": b["y"], "x": b["x"]}]) is None
    assert joint_measurements([a, {"x": b["x"]}]) is None


def switch_with_a_prefetch_in_flight(sim):
    """Shape a twice (the second forward ends by prefetching its first group), then shape b,
    whose measuring plan sizes its one slot differently: the slots are freed while that copy
    may still write one."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(FluxLike(d=48))
        a, b = shapes("reshaped")
        refs = (model(*a), model(*b))
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, *a))
        with eng.session():
            outs = [eng.run(model, *a), eng.run(model, *a)]
            assert eng.executor.memory.slots and len(eng.executor.memory.slots) == 2
            outs.append(eng.run(model, *b))
    return outs, refs


def test_freeing_a_slot_a_prefetch_still_writes(sim):
    outs, refs = switch_with_a_prefetch_in_flight(sim)
    assert torch.equal(outs[0], refs[0]) and torch.equal(outs[1], refs[0]) and torch.equal(outs[2], refs[1])


def test_sim_catches_freeing_a_slot_a_prefetch_still_writes(sim, monkeypatch):
    from vramcut_core.runtime import transfers
    monkeypatch.setattr(transfers.Transfers, "order_after_copies", lambda self: None)
    switch_with_a_prefetch_in_flight(sim)
    found = [h for h in sim.hazards if "freed and reused" in h or "write racing" in h or "may still read" in h]
    sim.hazards.clear()
    assert found, "freeing a slot with its prefetch in flight must be a hazard"
