"""A model planned all resident keeps its weights swapped in between the steps of a sampling run
(no hooks, no pointer swaps per step) and points them back at the host's weights when the run
ends (its device copies stay for the next prompt, until the host loads another model of them): the latents match
the unpatched model bit for bit, with a LoRA applied before or after the node, and the model the
patch shares its weights with is whole again after the run (values, objects, memory; with a
LoRA, once the host has loaded the original again)."""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm


def snapshot(module):
    return {n: (t, t.device, t.data_ptr(), t.detach().clone()) for n, t in
            list(module.named_parameters()) + list(module.named_buffers())}


def assert_same(module, snap):
    now = dict(list(module.named_parameters()) + list(module.named_buffers()))
    assert set(now) == set(snap)
    for n, (t, dev, ptr, vals) in snap.items():
        assert now[n] is t and now[n].device == dev, n
        assert now[n].data_ptr() == ptr, f"{n}: points at other memory (held weights not given back?)"
        assert torch.equal(now[n].detach(), vals), n


def sample(model, pos, neg, latent_shape, steps, callback):
    import comfy.sample
    latent = torch.zeros(tuple(latent_shape))
    latent = comfy.sample.fix_empty_latent_channels(model, latent)
    noise = comfy.sample.prepare_noise(latent, 0)
    return comfy.sample.sample(model, noise, steps, 2.0, "euler", "simple", pos, neg, latent,
                               denoise=1.0, disable_pbar=True, seed=0, callback=callback)


@pytest.mark.parametrize("lora", ["none", "before", "after"])
def test_all_resident_model_holds_weights_only_inside_the_run(comfy, max_vram, pack, lora):
    import comfy.sd

    model = tm.load_tiny_sd3(depth=4, seed=5)
    pos, neg = tm.tiny_sd3_conditioning()
    latent = (1, 16, 8, 8)
    lora_sd = tm.tiny_lora_for(model, seed=9)
    with_lora = lambda m: comfy.sd.load_lora_for_models(m, None, lora_sd, 1.0, 0.0)[0]  # noqa: E731
    ref = tm.sample(with_lora(model), pos, neg, latent, steps=4) if lora != "none" else None
    plain = tm.sample(model, pos, neg, latent, steps=4)  # the original loaded again: weights as loaded
    ref = plain if ref is None else ref
    if lora != "none":
        assert not torch.equal(ref, plain), "the LoRA must matter"
    module = model.model.diffusion_model
    snap = snapshot(module)
    (patched, _, _), payload = max_vram(8.0, model=with_lora(model) if lora == "before" else model)
    if lora == "after":
        patched = with_lora(patched)
    state = pack.nodes.patcher.state_of(patched)
    held = []

    def step(*_a):
        held.append([e.executor.holds_weights for e in state._engines.values()])

    out = sample(patched, pos, neg, latent, 4, step)
    assert torch.equal(out, ref), f"max diff {(out - ref).abs().max()}"
    assert payload["models"][0]["plan"]["streamed_bytes_per_forward"] == 0, "the budget should keep all resident"
    assert any(h and all(h) for h in held[1:]), f"weights were not held between steps: {held}"
    assert not state.in_run
    # the weights point at their masters again; the device copies stay for the next prompt
    assert all(not e.executor.holds_weights and e.executor.device_bytes > 0 for e in state._engines.values())
    if lora == "none":  # (a LoRA the host merges itself stays merged until another clone loads)
        assert_same(module, snap)
    # the shared weights carry no LoRA of ours: the original samples as before, and once the host
    # has loaded it (the patched model no longer counted as loaded) nothing is held for the patch
    assert torch.equal(tm.sample(model, pos, neg, latent, steps=4), plain)
    assert all(e.executor.device_bytes == 0 for e in state._engines.values())
    assert_same(module, snap)


def test_cond_and_uncond_batch_as_if_the_held_weights_were_free(comfy, max_vram, pack, monkeypatch):
    """The host runs cond and uncond as one batch only when ``memory_required(batch) * 1.5`` is
    below the free memory it sees. Weights the engines hold between steps are given back on
    demand, so they count as free on every host: ComfyUI 0.3.x asks ``model_management`` (the
    pack tells the sampler through a CALC_COND_BATCH wrapper), newer hosts ask the patcher."""
    import comfy.model_management as mm

    model = tm.load_tiny_sd3(depth=4, seed=5)
    pos, neg = tm.tiny_sd3_conditioning()
    (patched, _, _), _ = max_vram(8.0, model=model)
    state = pack.nodes.patcher.state_of(patched)
    free = 1 << 30
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (free, free) if torch_free_too else free)
    cls = type(patched.model)
    plain_required = cls.memory_required
    decisions = []

    def memory_required(self, input_shape, *a, **k):
        if not state.in_run or input_shape[0] != 2:
            return plain_required(self, input_shape, *a, **k)
        held = sum(e.held_bytes for e in state._engines.values())
        decisions.append(held)
        # cond and uncond together fit only if what the engines hold is counted as free
        return (free + held // 2) / 1.5

    monkeypatch.setattr(cls, "memory_required", memory_required)
    batches = []
    from torch._subclasses.fake_tensor import FakeTensor

    # real forwards only: the dry run before each new shape runs the model on fake tensors
    hook = patched.model.diffusion_model.register_forward_pre_hook(
        lambda m, a: None if isinstance(a[0], FakeTensor) else batches.append(a[0].shape[0]))
    try:
        sample(patched, pos, neg, (1, 16, 8, 8), 4, None)
    finally:
        hook.remove()
    assert len(decisions) == 4 and decisions[0] == 0 and all(decisions[1:]), decisions
    # step 1 holds nothing yet: cond and uncond run apart; from step 2 on, together
    assert batches == [1, 1, 2, 2, 2], batches
    assert "memory_required" not in patched.model.__dict__, "the sampler's view is restored after each call"
