"""A teardown of a patched model on a host that page-locks the offloaded weights itself (ComfyUI
0.33+: ``ModelPatcher.pin_weight_to_device`` at load, ``unpin_all_weights`` at unpatch, by
address, in ``comfy.model_management.PINNED_MEMORY``), on the simulated accelerator.

The host pins each weight where it lies; the engines copy from there and, during a forward, point
the parameters at their device copies. A detach from inside a forward must not let the host
unpin those device copies (it would warn for each weight and leave its own page-locked tensors
registered for good): the unpin is deferred to the forward's end, when the parameters are the
host's tensors again. Both orders end with nothing page-locked, no warning, and the next run
exact. Hosts without their own pinning (0.3.6x) skip.
"""
from __future__ import annotations

import gc
import logging
import types

import pytest
import torch

from compiler_host import BaseModelStandIn

STEPS = 3
GIB = 1 << 30


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        import comfy.ops
        ops = comfy.ops.disable_weight_init
        self.fc1, self.fc2 = ops.Linear(d, 2 * d), ops.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Stack(torch.nn.Module):
    """Host layers (``comfy.ops``, so the host offloads and pins them) in a block list."""

    def __init__(self, d: int = 32, depth: int = 6) -> None:
        super().__init__()
        import comfy.ops
        ops = comfy.ops.disable_weight_init
        self.inp = ops.Linear(16, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(depth))
        self.out = ops.Linear(d, 16)

    def forward(self, x, timestep, **_):
        h = self.inp(x) * timestep[:, None, None]
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _setup(sim, pack, clones=1):
    import comfy.model_patcher

    with sim.host_memory():
        torch.manual_seed(0)
        model = Stack()
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(2, 8, 16, generator=g), torch.rand(2, generator=g)
        with torch.no_grad():
            ref = model(x, t)
    st = pack.nodes.state
    base = BaseModelStandIn(model)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cuda"),
                                               offload_device=torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    settings = st.Settings(max_vram_gb=weights * 0.6 / GIB)  # about half the weights streamed
    made = [pack.nodes.patching.patch_model(patcher, settings, pack.nodes.report.NodeReport(None, settings)) for _ in range(clones)]
    return model, base, (made[0] if clones == 1 else made), (x, t), ref


def _run(base, clone, inputs, steps=STEPS):
    """A sampling run as ComfyUI runs it: the load (the host pins the offloaded weights), then
    ON_PRE_RUN, each step through the APPLY_MODEL wrappers, ON_CLEANUP."""
    import comfy.patcher_extension as pe

    clone.load(torch.device("cuda"))
    options = {"transformer_options": {"wrappers": clone.wrappers}}
    outer = pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, options, is_model_options=True)
    apply = pe.get_all_wrappers(pe.WrappersMP.APPLY_MODEL, options["transformer_options"])

    def run(n):
        clone.pre_run()
        base.current_patcher = clone
        try:
            return [pe.WrapperExecutor.new_class_executor(
                lambda x_, t_: base.diffusion_model(x_, t_), base, apply).execute(*inputs) for _ in range(n)]
        finally:
            clone.cleanup()

    with torch.no_grad():
        return pe.WrapperExecutor.new_class_executor(run, types.SimpleNamespace(model_patcher=clone),
                                                     outer).execute(steps)


def _pinned_by_host(mm, sim, ptrs):
    return {p for p in ptrs if p in mm.PINNED_MEMORY or p in sim.registered}


@pytest.mark.parametrize("when", ["during_a_forward", "after_the_run"])
def test_a_detach_leaves_nothing_page_locked_and_the_next_run_is_exact(sim, host_pins, pack, caplog, when):
    mm = host_pins
    model, base, clone, inputs, ref = _setup(sim, pack)
    ptrs = {p.data_ptr() for p in model.parameters()}
    # the host's tensors stay allocated to the end, so no later allocation (a master the pack
    # page-locks once the host has let go of its pins) can take one of these addresses
    kept = [p.untyped_storage() for p in model.parameters()]  # noqa: F841
    engine = pack.nodes.state.state_of(clone)._engines[model]
    detached = []

    def hook(_mod, _args, _out):
        if not detached and engine.executor.running:
            clone.detach(unpatch_all=True)
            detached.append(True)

    h = model.blocks[2].register_forward_hook(hook) if when == "during_a_forward" else None
    with caplog.at_level(logging.WARNING):
        try:
            pinned_at_load = []
            clone_load = clone.load

            def load(*a, **k):  # what the host pinned at the load
                out = clone_load(*a, **k)
                pinned_at_load.append(len(_pinned_by_host(mm, sim, ptrs)))
                return out

            clone.load = load
            outs = _run(base, clone, inputs)
        finally:
            if h is not None:
                h.remove()
            del clone.load
        # the host's unload after the run (this run bypasses its load_models_gpu, so its
        # unload_all_models does not see the model; during_a_forward, the run kept what it
        # copied after the teardown for the next prompt)
        clone.detach(unpatch_all=True)
        detached.append(True)
        mm.unload_all_models()
        gc.collect()
        assert detached
        assert pinned_at_load and pinned_at_load[0] == len(ptrs), "the host pinned every weight at its load"
        assert all(torch.equal(o, ref) for o in outs)
        assert not _pinned_by_host(mm, sim, ptrs), "page-locked host memory left behind"
        assert mm.TOTAL_PINNED_MEMORY == 0 and not mm.PINNED_MEMORY
        assert not clone.pinned
        assert engine.executor.device_bytes == 0 and not any(sim.is_device(p) for p in model.parameters())
        # the next run: pinned again at its load, exact, and given back at its end
        again = _run(base, clone, inputs)
        assert all(torch.equal(o, ref) for o in again)
        clone.detach(unpatch_all=True)
        assert not _pinned_by_host(mm, sim, ptrs) and mm.TOTAL_PINNED_MEMORY == 0
    warned = [r.getMessage() for r in caplog.records if "unpin" in r.getMessage().lower()]
    assert not warned, warned[:3]


def test_another_clone_unpinning_the_shared_weights_waits_for_the_copies_reading_them(sim, host_pins, pack):
    """Clones of one model share the host's pinned weights (``ModelPatcher.pinned``), and a clone
    that goes (its ``__del__``) unpins them all. A second patch of the same model going while the
    first streams: every engine's copies land before the host unregisters the memory they read
    (without that wait the simulator sees host memory unregistered under a copy)."""
    mm = host_pins
    model, base, (clone, other), inputs, ref = _setup(sim, pack, clones=2)
    kept = [p.untyped_storage() for p in model.parameters()]  # noqa: F841
    engine = pack.nodes.state.state_of(clone)._engines[model]
    gone = []

    def hook(_mod, _args, _out):
        if not gone and engine.executor.running and clone.pinned:
            other.unpin_all_weights()   # what the other clone's __del__ does first
            gone.append(True)

    h = model.blocks[1].register_forward_hook(hook)
    try:
        outs = _run(base, clone, inputs)
    finally:
        h.remove()
    assert gone and all(torch.equal(o, ref) for o in outs)
    assert not sim.hazards, sim.hazards[:3]
    clone.detach(unpatch_all=True)
    mm.unload_all_models()
    gc.collect()
