"""comfy-kitchen ``QuantizedTensor`` weights (what ComfyUI 0.33+ loads fp8, mxfp8 and nvfp4
checkpoints into) on the simulated accelerator, with prefetch.

The simulator runs the tensor type's own dispatch with its checks on (tests/sim_cuda.py), so a
``detach`` or ``clone`` of a weight whose slot copy is not yet ordered is a read-before-copy
hazard, and anything it allocates is device memory the allocator counts. Each forward is
compared bit for bit with the plain one; every quantized weight a layer sees on the device must
live, all its parts, inside the executor's own buffers (nothing copied out, nothing uncounted).
"""
import gc

import pytest
import torch

pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (PyPI, in the test extra: pip install -e '.[test]') "
                    "is not installed in this environment")

import kitchen_toys as kt  # noqa: E402
from test_sim_cuda import budget_for, cuda_engine, fresh_peak, sim  # noqa: E402,F401

FORWARDS = 5


def reference(sim, layout):
    with sim.host_memory(), torch.no_grad():
        model = kt.KitchenStack(layout)
        args = kt.inputs()
        return model, args, model(*args)


class PartsWatch:
    """Forward hooks on every quantized layer: the storages a layer's device weight reads."""

    def __init__(self, sim, model) -> None:
        self.sim, self.seen, self.outside = sim, 0, {}
        self.handles = [m.register_forward_hook(self.check) for m in model.modules()
                        if isinstance(m, kt.KitchenLinear)]

    def check(self, mod, _args, _out) -> None:
        w = mod.weight
        parts = kt.inner(w)
        if not self.sim.is_device(parts[0]):
            return
        self.seen += 1
        home = parts[0].untyped_storage().data_ptr()
        for p in parts[1:]:
            st = p.untyped_storage()
            if st.data_ptr() != home:   # a part copied out of the executor's buffer
                self.outside[st.data_ptr()] = st.nbytes()

    @property
    def outside_bytes(self) -> int:
        return sum(self.outside.values())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("layout", list(kt.LAYOUTS))
def test_kitchen_weights_exact_on_every_forward_with_prefetch(sim, layout):
    model, args, ref = reference(sim, layout)
    objects = {n: p for n, p in kt.quantized_weights(model)}
    with torch.no_grad():
        budget = budget_for(model, *args)
        eng = cuda_engine(model, budget)
        fresh_peak(sim)
        base = sim.alloc.high_allocated = sim.alloc.allocated
        outs = []
        with eng.session():
            for _ in range(FORWARDS):
                outs.append(eng.run(model, *args))
        plan = eng.last_plan
        assert plan.slots == 2 and plan.streamed_bytes_per_forward > 0, "the scenario needs prefetch"
        for i, o in enumerate(outs, 1):
            assert torch.equal(o, ref), f"{layout}: forward {i} differs from the plain forward " \
                                        f"(max |diff| {(o.float() - ref.float()).abs().max().item()})"
        # Device bytes in use (the executor's buffers, activations, the dequantized temporaries)
        # within the budget on every forward. (The simulated allocator's reserved bytes can pass
        # it by the holes the dequantize temporaries leave in its one arena per stream;
        # bench/gpu_check.py reads the real allocator's.)
        slack = 16 * sim.alloc.at_peak_blocks + sum(o.untyped_storage().nbytes() for o in outs)
        assert sim.alloc.high_allocated - base <= budget + slack, \
            f"{layout}: {sim.alloc.high_allocated - base} B allocated at the peak, budget {budget} B"
    after = dict(kt.quantized_weights(model))
    for n, q in objects.items():
        assert after[n] is q, f"{n}: object replaced"
        assert not any(sim.is_device(p) for p in kt.inner(q)), f"{n}: left on the device"


@pytest.mark.parametrize("layout", list(kt.LAYOUTS))
def test_kitchen_weight_parts_stay_in_the_executors_buffers(sim, layout):
    """No part (scale, block scale) is copied out of the slot: such a copy is device memory the
    budget does not count, read before the slot's copy is ordered."""
    model, args, ref = reference(sim, layout)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, *args))
        watch = PartsWatch(sim, model)
        try:
            with eng.session():
                for _ in range(3):
                    eng.run(model, *args)
        finally:
            watch.remove()
    assert watch.seen, "no quantized weight was seen on the device"
    weights = sum(sum(p.untyped_storage().nbytes() for p in kt.inner(q)) for _, q in kt.quantized_weights(model))
    assert watch.outside_bytes == 0, \
        f"{layout}: {watch.outside_bytes} B of weight parts outside the executor's buffers " \
        f"({100 * watch.outside_bytes / weights:.1f} % of the quantized weights' bytes)"
    gc.collect()
