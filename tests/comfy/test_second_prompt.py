"""A later prompt on the same patched model copies nothing the engines still hold (issue 41).

What the host does between two prompts on one patched model, on every tested release (0.3.64,
0.33.0, and the newest's source alike): the sampler's run ends with the patcher's ``cleanup()``
(ON_CLEANUP, then the host's hook cleanup, ``patch_hooks(None)``); the next prompt's sampler calls
``load_models_gpu`` on the same patcher, which finds it loaded, asks it ``is_clone`` of every
loaded model, detaches each clone it finds (``detach(unpatch_all=False)``: the very patcher it
loads again included) and loads it again. Each step used to give every device copy back: the
next prompt's first call copied every resident weight again, with host syncs (the tiny SD1.5
UNet on 2 simulated devices: 26 host syncs in the second prompt, 16 at its load and 10 as its
run ended, and its 4 resident blocks copied again in its first call).

A prompt here is what the host's sampler does around its steps (``prompt``): ``prepare_sampling``
(its ``load_models_gpu``), ON_PRE_RUN, the host's ``apply_model`` with the patched model's
wrappers, the patcher's ``cleanup()``, ``cleanup_models``. The real sampler moves its tensors to
the load device itself, which the simulated accelerator cannot stand in for: it runs on CPU in
the last test, with the same counts. What the engines keep goes when the host unloads the model,
makes room for another model, loads another model of the same network, when the patches or the
budget change and when the patched model is deleted.
"""
from __future__ import annotations

import gc

import pytest
import torch

import tiny_models as tm
from host_cases import call, sampling, simulated_host
from pack_nodes import run_node

GIB = 1 << 30
CALLS = 3


def _g(seed):
    return torch.Generator().manual_seed(seed)


FAMILIES = {
    "sd15_unet": (tm.load_tiny_sd15_unet, lambda: (torch.randn(1, 4, 8, 8, generator=_g(1)), torch.full((1,), 2.5),
                                                   {"c_crossattn": torch.randn(1, 6, 32, generator=_g(2))})),
    "sd3_mmdit": (lambda: tm.load_tiny_sd3(depth=4, seed=1),
                  lambda: (torch.randn(1, 16, 8, 8, generator=_g(1)), torch.full((1,), 0.7),
                           {"c_crossattn": torch.randn(1, 8, 32, generator=_g(2)),
                            "y": torch.randn(1, 32, generator=_g(3))})),
}


class Calls:
    """Each engine call's stats (copies, resident loads), in order."""

    def __init__(self, pack, monkeypatch) -> None:
        self.seen: list = []
        Engine = pack.vramcut_core.engine.Engine
        record = Engine._record

        def recording(eng, plan, sig, stats):
            self.seen.append(stats)
            return record(eng, plan, sig, stats)

        monkeypatch.setattr(Engine, "_record", recording)

    def take(self) -> list:
        out, self.seen = self.seen, []
        return out


def prompt(sim, clone, xs, calls=CALLS):
    """One prompt's sampler on ``clone``: the host's load, a sampling run of ``calls`` steps, the
    host's cleanup. Returns (outputs, host syncs in the whole prompt)."""
    import comfy.sampler_helpers as sh

    s0 = sim.host_syncs
    _, _, loaded = sh.prepare_sampling(clone, xs[0].shape, {}, clone.model_options)
    with torch.no_grad():
        outs = sampling(clone, lambda: [call(clone.model, clone, xs) for _ in range(calls)])
    sh.cleanup_models({}, loaded)
    return outs, sim.host_syncs - s0


def patch(pack, max_vram, model, n, share, node_id="1"):
    """The Max VRAM node on ``model``: one device at ``share`` of the weights, or ``n`` devices
    at ``share`` each (a Devices node)."""
    total = sum(u.weight_bytes for u in pack.vramcut_core.find_units(model.model.diffusion_model).units)
    if n == 1:
        (clone, _, _), _ = max_vram(total * share / GIB, model=model, node_id=node_id)
    else:
        (devices,), _ = run_node(pack, "VRAMCutDevices", devices=", ".join(
            f"cuda:{i}={total * share / GIB:.9f}" for i in range(n)), reserve_gb=1.0)
        (clone, _, _), _ = max_vram(1.0, model=model, devices=devices, node_id=node_id)
    return clone


def whole(module, host: dict, sim) -> None:
    """The module as the host left it: its own tensors, none on a device, no hook of ours."""
    for k, t in list(module.named_parameters()) + list(module.named_buffers()):
        assert t is host[k] and not sim.is_device(t), f"{k}: not the host's own tensor between prompts"
    hooked = [n for n, m in module.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    assert not hooked, f"hooks left on the module between prompts: {hooked[:5]}"


@pytest.mark.parametrize("n", [1, 2], ids=["1gpu", "2gpu"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_later_prompt_copies_nothing_the_engines_hold(comfy, pack, max_vram, monkeypatch, family, n):
    import comfy.model_management as mm

    load, inputs = FAMILIES[family]
    with simulated_host(monkeypatch, pack, devices=n) as sim:
        with sim.host_memory():
            model = load()
            host_in = inputs()
            with torch.no_grad():
                ref = model.model.apply_model(host_in[0], host_in[1], **host_in[2])
        model.load_device = torch.device("cuda", 0)   # a CUDA host's load device
        xs = inputs()   # made outside host memory: cuda:0's
        module = model.model.diffusion_model
        host = dict(list(module.named_parameters()) + list(module.named_buffers()))
        clone = patch(pack, max_vram, model, n, 0.8 if n == 1 else 0.48)
        state = pack.nodes.state.state_of(clone)
        calls = Calls(pack, monkeypatch)
        for a in sim.allocs.values():
            a.empty_cache()

        outs, _ = prompt(sim, clone, xs)
        first = calls.take()
        (engine,) = state.engines()
        plan = engine.last_plan
        assert plan.resident_units and plan.streamed_groups, "the budget keeps some blocks resident, streams others"
        assert sum(s.resident_loads for s in first) > 0
        steady = first[-1]
        held = dict(engine.held_bytes_by_device)
        whole(module, host, sim)
        # the host counts what the engines hold on its load device as loaded: it frees for the next
        # prompt only what the budget lacks (it read 0 and freed the held bytes again, unloading
        # other models for room this one already had)
        on_load = held.get("cuda:0", 0)
        assert on_load > 0 and clone.loaded_size() == on_load, (clone.loaded_size(), held)
        assert mm.LoadedModel(clone).model_offloaded_memory() == clone.model_size() - on_load

        for k in (2, 3):
            outs_k, syncs = prompt(sim, clone, xs)
            stats = calls.take()
            copies = [(s.resident_loads, s.bytes_streamed, s.copies, s.sync_loads) for s in stats]
            assert (syncs, copies) == (0, [(0, steady.bytes_streamed, steady.copies, 0)] * CALLS), (
                f"prompt {k}: {syncs} host syncs; (resident copies, bytes streamed, copies, loads not "
                f"prefetched) per call {copies}; a steady call of prompt 1 streams {steady.bytes_streamed} B "
                f"in {steady.copies} copies")
            assert engine.held_bytes_by_device == held and sum(held.values()) > 0
            for o in outs + outs_k:
                assert torch.equal(o, ref), f"prompt {k}: differs from the unpatched model"
            whole(module, host, sim)

        # the host unloads the model: nothing is held on any device
        mm.unload_all_models()
        assert engine.held_bytes == 0 and clone.loaded_size() == 0
        assert all(sim.allocs[i].allocated == 0 for i in range(1, n)), "memory left on another device"
        del clone, state, engine
        gc.collect()


def test_what_the_engines_hold_goes_when_the_model_changes_hands(comfy, pack, max_vram, monkeypatch):
    """Kept across prompts only while the same patch is loaded again: given back when the host
    makes room for another model, loads another model of the same network (the original: the
    host no longer counts the patched one as loaded), when the patches merged into the copies
    change (a LoRA applied after the node), when the budget changes (another Max VRAM node's
    patch) and when the patched model is deleted."""
    import comfy.model_management as mm
    import comfy.sd

    load, inputs = FAMILIES["sd3_mmdit"]
    with simulated_host(monkeypatch, pack) as sim:
        with sim.host_memory():
            model = load()
            lora = tm.tiny_lora_for(model, seed=3)
        model.load_device = torch.device("cuda", 0)
        xs = inputs()
        dev = torch.device("cuda", 0)
        clone = patch(pack, max_vram, model, 1, 0.6)
        state = pack.nodes.state.state_of(clone)
        calls = Calls(pack, monkeypatch)
        base_alloc = sim.alloc.allocated

        def held():
            return sum(e.held_bytes for e in state.engines())

        # the host makes room for another model on the device
        prompt(sim, clone, xs)
        assert held() > 0
        mm.free_memory(mm.get_free_memory(dev) + 1, dev)
        assert held() == 0 and sim.alloc.allocated == base_alloc

        # another model of the same network is loaded: the original (on the CPU here)
        prompt(sim, clone, xs)
        assert held() > 0
        model.load_device = torch.device("cpu")
        mm.load_models_gpu([model])
        assert held() == 0, "the host no longer counts the patched model as loaded: nothing may stay"
        model.load_device = dev

        # the patches change: a LoRA after the node (the same patch state, other weights)
        plain, _ = prompt(sim, clone, xs)
        calls.take()
        with_lora = comfy.sd.load_lora_for_models(clone, None, lora, 1.0, 0)[0]
        assert pack.nodes.state.state_of(with_lora) is state
        merged, _ = prompt(sim, with_lora, xs)
        assert calls.take()[0].resident_loads > 0, "copies merged with other patches were used"
        assert not torch.equal(merged[0], plain[0]), "the LoRA must matter"
        again, _ = prompt(sim, clone, xs)
        assert calls.take()[0].resident_loads > 0 and torch.equal(again[0], plain[0])
        del with_lora

        # the budget changes: another Max VRAM node's patch of the same model
        other = patch(pack, max_vram, model, 1, 0.8, node_id="2")
        prompt(sim, other, xs)
        assert held() == 0, "the old budget's copies stay beside the new ones"
        prompt(sim, clone, xs)

        # the patched model is deleted
        assert held() > 0
        del clone, other, plain, merged, again   # (the outputs are device memory too)
        assert sim.alloc.allocated == base_alloc, "a deleted patch's copies stay on the device"
        mm.unload_all_models()
        del state
        gc.collect()


def test_a_later_prompt_through_the_host_sampler_copies_nothing_again(comfy, pack, max_vram, monkeypatch):
    """The host's own sampler (``comfy.sample.sample``, KSampler's path) twice on CPU: the second
    prompt's calls are steady calls (no resident weight copied again), the latents equal."""
    model = tm.load_tiny_sd3(depth=4, seed=1)
    pos, neg = tm.tiny_sd3_conditioning()
    clone = patch(pack, max_vram, model, 1, 0.6)
    calls = Calls(pack, monkeypatch)
    first_latent = tm.sample(clone, pos, neg, (1, 16, 8, 8), steps=3)
    first = calls.take()
    (engine,) = pack.nodes.state.state_of(clone).engines()
    assert engine.last_plan.resident_units and engine.last_plan.streamed_groups
    assert first[0].resident_loads > 0
    second_latent = tm.sample(clone, pos, neg, (1, 16, 8, 8), steps=3)
    second = calls.take()
    assert [s.resident_loads for s in second] == [0] * len(second), "the second prompt copied resident weights again"
    assert {(s.bytes_streamed, s.copies) for s in second} == {(first[-1].bytes_streamed, first[-1].copies)}
    assert torch.equal(first_latent, second_latent)
