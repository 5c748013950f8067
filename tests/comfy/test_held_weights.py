"""A model planned all resident keeps its weights swapped in between the steps of a sampling run
(no hooks, no pointer swaps per step) and gives them back when the run ends: the latents match
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
    state = pack.nodes.host.state_of(patched)
    held = []

    def step(*_a):
        held.append([e.executor.holds_weights for e in state._engines.values()])

    out = sample(patched, pos, neg, latent, 4, step)
    assert torch.equal(out, ref), f"max diff {(out - ref).abs().max()}"
    assert payload["models"][0]["plan"]["streamed_bytes_per_forward"] == 0, "the budget should keep all resident"
    assert any(h and all(h) for h in held[1:]), f"weights were not held between steps: {held}"
    assert not state.in_run
    assert all(not e.executor.holds_weights and e.executor.device_bytes == 0 for e in state._engines.values())
    if lora == "none":  # (a LoRA the host merges itself stays merged until another clone loads)
        assert_same(module, snap)
    # the shared weights carry no LoRA of ours: the original samples as before
    assert torch.equal(tm.sample(model, pos, neg, latent, steps=4), plain)
    assert_same(module, snap)
