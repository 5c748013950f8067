"""ControlNet on a VRAMCut-patched MODEL: a tiny SD3 (MMDiT) ControlNet, loaded through ComfyUI's
own loader and applied the way the ``ControlNetApplyAdvanced`` node does, gives the same latents
bit for bit through the patched model as through the unpatched one.

The ControlNet is built as a real file would be read: ``comfy.cldm.mmdit.ControlNet`` (the module
``comfy.controlnet.load_controlnet_mmdit`` builds) is filled with seeded weights, its ComfyUI key
names are converted back to the diffusers SD3 ControlNet layout (``transformer_blocks.N.attn.to_q``,
``pos_embed.proj``, ``controlnet_blocks.N``, ``pos_embed_input.proj``, ...) by inverting
``comfy.utils.mmdit_to_diffusers``, and that dict goes to ``comfy.controlnet.load_controlnet_state_dict``,
which detects it ("controlnet_blocks.0.weight" + "pos_embed_input.proj.weight", no
"adaLN_modulation": SD3 diffusers ControlNet), converts it with ``convert_diffusers_mmdit`` and infers
the config from the weights (hidden 64 * depth, so it pairs with ``load_tiny_sd3(depth=4)``).
Its hint is VAE-encoded (SD3 ControlNets take latents), so a tiny 16-channel VAE goes with it.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from unit_checks import assert_peak_within_budget

GIB = 1 << 30
DEPTH = 4          # the tiny SD3: hidden 256, 4 joint blocks
CN_BLOCKS = 2      # ControlNet blocks (fewer than the model's, as real SD3 ControlNets have)
LATENT = (1, 16, 8, 8)


def budget_gb(model, share=0.45):
    """As in test_model_path: below the diffusion model's weights, so that something streams."""
    from vramcut_core import find_units
    us = find_units(model.model.diffusion_model)
    sizes = sorted((u.weight_bytes for u in us.units), reverse=True)
    return max(us.weight_bytes * share, sizes[0] + 2.2 * sizes[1] + (1 << 20)) / GIB


def tiny_sd3_controlnet_state_dict(depth=DEPTH, num_blocks=CN_BLOCKS, seed=7):
    """A diffusers-format SD3 ControlNet state dict (what ``load_controlnet_mmdit`` reads)."""
    import comfy.cldm.mmdit
    import comfy.utils

    m = comfy.cldm.mmdit.ControlNet(num_blocks=num_blocks, control_latent_channels=16, dtype=torch.float32,
                                    device="cpu", operations=tm._ops(), **tm.tiny_sd3_config(depth))
    csd = tm._module_state_dict(m, seed)
    # invert ComfyUI's diffusers -> MMDiT key map: (target, (dim, start, length)[, fun]) entries
    # are slices of the fused qkv weights; fun is swap_scale_shift, its own inverse
    out, used = {}, set()
    for dk, t in comfy.utils.mmdit_to_diffusers({"depth": depth, "num_blocks": num_blocks}).items():
        target = t if isinstance(t, str) else t[0]
        if target not in csd:
            continue
        w = csd[target]
        if not isinstance(t, str):
            if t[1] is not None:
                w = w.narrow(*t[1])
            if len(t) > 2:
                w = t[2](w)
        out[dk] = w.clone()
        used.add(target)
    leftover = [k for k in csd if k not in used]
    assert sorted(leftover) == sorted(
        [f"controlnet_blocks.{i}.{p}" for i in range(num_blocks) for p in ("weight", "bias")]
        + ["pos_embed_input.proj.weight", "pos_embed_input.proj.bias"]), leftover
    out.update({k: csd[k].clone() for k in leftover})  # same names in both layouts
    return out, csd


def apply_controlnet(positive, negative, control_net, image, vae, strength=1.0):
    """(positive, negative) from ComfyUI's ControlNetApplyAdvanced node, V1 or V3 style."""
    from nodes import ControlNetApplyAdvanced as cls

    inputs = dict(positive=positive, negative=negative, control_net=control_net, image=image,
                  strength=strength, start_percent=0.0, end_percent=1.0, vae=vae)
    if hasattr(cls, "define_schema"):
        res = cls.execute(**inputs).result
    else:
        res = getattr(cls(), cls.FUNCTION)(**inputs)
    return res[0], res[1]


@pytest.fixture(scope="module")
def setup(comfy):
    import comfy.controlnet

    model = tm.load_tiny_sd3(depth=DEPTH)
    diffusers_sd, comfy_sd = tiny_sd3_controlnet_state_dict()
    cn = comfy.controlnet.load_controlnet_state_dict(tm._copy_sd(diffusers_sd))
    assert type(cn).__name__ == "ControlNet" and type(cn.control_model).__module__ == "comfy.cldm.mmdit"
    loaded = cn.control_model.state_dict()
    assert set(loaded) == set(comfy_sd) and all(torch.equal(loaded[k], comfy_sd[k]) for k in comfy_sd), \
        "ComfyUI's loader must read back exactly the weights written"
    vae = tm.load_tiny_vae(seed=1, config=tm.tiny_vae_config(z_channels=16))
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(3))  # 8x8 latent x 8
    pos, neg = tm.tiny_sd3_conditioning()
    return model, cn, vae, image, pos, neg


def test_controlnet_on_patched_model_matches_unpatched(setup, max_vram, pack):
    model, cn, vae, image, pos, neg = setup
    with tm.torch_threads(1):
        cpos, cneg = apply_controlnet(pos, neg, cn, image, vae)
        assert cpos[0][1]["control"] is cneg[0][1]["control"]
        ref = tm.sample(model, cpos, cneg, LATENT, steps=3)
        plain = tm.sample(model, pos, neg, LATENT, steps=3)
        assert not torch.equal(ref, plain), "the ControlNet must change the output"
        assert torch.isfinite(ref).all()

        (patched, _, _), payload = max_vram(budget_gb(model), model=model)
        assert patched is not model
        # conditioning made by the node again, as a fresh prompt would (no cached hint)
        cpos2, cneg2 = apply_controlnet(pos, neg, cn, image, vae)
        out = tm.sample(patched, cpos2, cneg2, LATENT, steps=3)
        assert torch.equal(out, ref), f"max diff {(out - ref).abs().max()}"
        assert_peak_within_budget(payload["models"][0]["plan"])  # the run with the measured first step
        # the same conditioning objects sampled once already (hint cached on the ControlNet copy)
        assert torch.equal(tm.sample(patched, cpos, cneg, LATENT, steps=3), ref)

        e = payload["models"][0]
        assert e["kind"] == "MODEL" and e["stage"] == "measured"
        assert e["plan"]["streamed_bytes_per_forward"] > 0, "the budget must make the model stream"
        assert e["plan"]["peak_bytes"] <= e["plan"]["budget_bytes"]
        # without the ControlNet the patched model still gives the plain result
        assert torch.equal(tm.sample(patched, pos, neg, LATENT, steps=3), plain)
        # and the unpatched model is unchanged
        assert torch.equal(tm.sample(model, cpos, cneg, LATENT, steps=3), ref)
    state = pack.nodes.patcher.state_of(patched)
    assert state is not None and not state.running
    assert all(en.executor.device_bytes == 0 for en in state._engines.values())


def test_controlnet_strength_and_range_follow_through_the_patched_model(setup, max_vram):
    """Half strength over the first half of the steps: a different result, still bit-exact."""
    from nodes import ControlNetApplyAdvanced as cls

    model, cn, vae, image, pos, neg = setup

    def cond():
        inputs = dict(positive=pos, negative=neg, control_net=cn, image=image, strength=0.5,
                      start_percent=0.0, end_percent=0.5, vae=vae)
        if hasattr(cls, "define_schema"):
            return cls.execute(**inputs).result[:2]
        return getattr(cls(), cls.FUNCTION)(**inputs)[:2]

    with tm.torch_threads(1):
        ref = tm.sample(model, *cond(), LATENT, steps=4)
        full = tm.sample(model, *apply_controlnet(pos, neg, cn, image, vae), LATENT, steps=4)
        assert not torch.equal(ref, full)
        (patched, _, _), _ = max_vram(budget_gb(model), model=model)
        assert torch.equal(tm.sample(patched, *cond(), LATENT, steps=4), ref)
