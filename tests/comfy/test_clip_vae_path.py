"""CLIP, VAE, upscale model and CLIP vision through the executor: patched vs unpatched, bit-exact
on CPU, the originals untouched."""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from pack_nodes import run_node
from unit_checks import assert_peak_within_budget

GIB = 1 << 30


@pytest.fixture(autouse=True)
def inference_mode():
    """ComfyUI runs every node under torch.inference_mode()."""
    with torch.inference_mode():
        yield


def params_snapshot(module):
    return {n: (t, t.device, t.detach().clone()) for n, t in module.state_dict(keep_vars=True).items()}


def assert_same(module, snap):
    now = module.state_dict(keep_vars=True)
    for n, (t, dev, vals) in snap.items():
        assert now[n] is t and now[n].device == dev and torch.equal(now[n].detach(), vals), n


def budget_gb_for(module, pinned_bytes=0, margin=2 << 20, share=0.5):
    """Room for what must stay resident, the largest unit resident, two slots of the next and a
    margin for these tiny models' activations; below the weights, so something streams."""
    from vramcut_core import find_units
    us = find_units(module)
    sizes = sorted((u.weight_bytes for u in us.units), reverse=True)
    return (max(us.weight_bytes * share, pinned_bytes + sizes[0] + 2.2 * sizes[1]) + margin) / GIB


def tight_budget_gb(plan_json):
    """From a measured plan at a generous budget: what must stay resident, a window of two of
    the largest other unit, the activations, and a little; streams all else."""
    units = plan_json["units"]
    pinned = sum(u["weight_bytes"] for u in units if u["keep_resident"])
    rest = sorted((u["weight_bytes"] for u in units if not u["keep_resident"]), reverse=True)
    need = pinned + 2.5 * rest[0] + plan_json["activation_reserve_bytes"] + (64 << 10)
    assert need < sum(u["weight_bytes"] for u in units) + plan_json["activation_reserve_bytes"], \
        "the model is too small to force streaming at any budget"
    return need / GIB


def entry(payload, kind):
    return next(e for e in payload["models"] if e["kind"] == kind)


# ------------------------------------------------------------------------------------------------
# CLIP

# Layers wide enough that streaming them is worth it next to the 49408- and 32128-token
# embeddings (which stay resident).
ENCODERS = {
    "clip_l": lambda: tm.load_tiny_clip_l(seed=0, config=dict(tm.TINY_CLIP_L_CONFIG, hidden_size=128,
                                                               intermediate_size=512, num_hidden_layers=4)),
    "t5": lambda: tm.load_tiny_t5(seed=0, config=dict(tm.TINY_T5_CONFIG, d_model=128, d_ff=512, d_kv=32,
                                                      num_layers=4)),
}


@pytest.fixture(params=list(ENCODERS))
def clip(request, comfy):
    return request.param, ENCODERS[request.param]()


def test_encode_matches_unpatched(clip, max_vram, pack):
    name, c = clip
    tokens = c.tokenize("a photo of a cat sitting on a red chair, highly detailed")
    ref_cond, ref_pooled = c.encode_from_tokens(tokens, return_pooled=True)
    snap = params_snapshot(c.cond_stage_model)
    (_, probe, _), probe_payload = max_vram(1.0, clip=c)
    probe.encode_from_tokens(tokens, return_pooled=True)
    (_, patched, _), payload = max_vram(tight_budget_gb(entry(probe_payload, "CLIP")["plan"]), clip=c)
    assert type(patched).__name__ == "VRAMCutCLIP" and type(c).__name__ == "CLIP"
    cond, pooled = patched.encode_from_tokens(tokens, return_pooled=True)
    assert torch.equal(cond, ref_cond)
    assert (pooled is None and ref_pooled is None) or torch.equal(pooled, ref_pooled)
    e = entry(payload, "CLIP")
    assert e["stage"] == "measured" and e["plan"]["streamed_bytes_per_forward"] > 0
    assert e["plan"]["peak_bytes"] <= e["plan"]["budget_bytes"]
    assert_peak_within_budget(e["plan"])
    # the input embedding stays resident: the encoder reads its device before anything runs
    resident = {u for s in e["plan"]["segments"] if s["resident"] for u in s["units"]}
    assert any(u.endswith("prelude") for u in resident)
    # scheduled encodes (what CLIPTextEncode calls) go through the engine too
    sched = patched.encode_from_tokens_scheduled(tokens)
    ref_sched = c.encode_from_tokens_scheduled(tokens)
    assert torch.equal(sched[0][0], ref_sched[0][0])
    assert_same(c.cond_stage_model, snap)
    assert not any("encode_token_weights" in vars(m) for m in [c.cond_stage_model])
    again, _ = c.encode_from_tokens(tokens, return_pooled=True)
    assert torch.equal(again, ref_cond)


def test_clip_stays_patched_through_clone_and_set_last_layer(comfy, max_vram):
    from nodes import CLIPSetLastLayer

    c = tm.load_tiny_clip_l(seed=1)
    (_, patched, _), _ = max_vram(budget_gb_for(c.cond_stage_model, margin=512 << 10), clip=c)
    tokens = c.tokenize("a cat")
    ref = CLIPSetLastLayer().set_last_layer(c, -2)[0].encode_from_tokens(tokens)
    pl = CLIPSetLastLayer().set_last_layer(patched, -2)[0]
    assert type(pl).__name__ == "VRAMCutCLIP"
    assert torch.equal(pl.encode_from_tokens(tokens), ref)


def test_clip_lora_on_patched_clip(comfy, max_vram):
    import comfy.sd

    c = tm.load_tiny_clip_l(seed=2)
    # ComfyUI maps "text_encoders.<state dict key>" LoRA keys onto a CLIP's weights
    lora = tm.tiny_lora_for(c.cond_stage_model.state_dict(), seed=5, prefix="text_encoders.")
    tokens = c.tokenize("a dog on the beach")
    _, with_lora = comfy.sd.load_lora_for_models(None, c, lora, 0.0, 1.0)
    ref = with_lora.encode_from_tokens(tokens)
    if torch.equal(ref, c.encode_from_tokens(tokens)):
        pytest.skip("the tiny LoRA has no keys this CLIP maps; nothing to compare")
    (_, patched, _), _ = max_vram(budget_gb_for(c.cond_stage_model, margin=512 << 10), clip=c)
    _, patched_lora = comfy.sd.load_lora_for_models(None, patched, lora, 0.0, 1.0)
    assert type(patched_lora).__name__ == "VRAMCutCLIP"
    assert torch.equal(patched_lora.encode_from_tokens(tokens), ref)
    (_, lora_then_patch, _), _ = max_vram(budget_gb_for(c.cond_stage_model, margin=512 << 10), clip=with_lora)
    assert torch.equal(lora_then_patch.encode_from_tokens(tokens), ref)


# ------------------------------------------------------------------------------------------------
# VAE


@pytest.fixture
def vae(comfy):
    return tm.load_tiny_vae(seed=0)


def test_vae_decode_encode_and_tiled_match_unpatched(vae, max_vram):
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 4, 16, 16, generator=g)
    image = torch.rand(1, 64, 64, 3, generator=g)
    ref_dec, ref_enc = vae.decode(latent), vae.encode(image)
    ref_tdec = vae.decode_tiled(latent, tile_x=8, tile_y=8, overlap=2)
    ref_tenc = vae.encode_tiled(image, tile_x=32, tile_y=32, overlap=8)
    snap = params_snapshot(vae.first_stage_model)
    (_, _, pv), payload = max_vram(budget_gb_for(vae.first_stage_model, margin=24 << 20), vae=vae)
    assert type(pv).__name__ == "VRAMCutVAE" and type(vae).__name__ == "VAE"
    assert torch.equal(pv.decode(latent), ref_dec)
    assert torch.equal(pv.encode(image), ref_enc)
    assert torch.equal(pv.decode_tiled(latent, tile_x=8, tile_y=8, overlap=2), ref_tdec)
    assert torch.equal(pv.encode_tiled(image, tile_x=32, tile_y=32, overlap=8), ref_tenc)
    e = entry(payload, "VAE")
    assert e["stage"] == "measured" and e["plan"]["peak_bytes"] <= e["plan"]["budget_bytes"]
    assert_peak_within_budget(e["plan"])
    assert_same(vae.first_stage_model, snap)
    assert torch.equal(vae.decode(latent), ref_dec)
    for name in ("decode", "encode"):
        assert name not in vars(vae.first_stage_model), "the shared model must not keep a wrapper"


def test_decode_too_big_for_the_budget_falls_back_to_comfyui_tiling(vae, max_vram, pack):
    """At a size whose activations the budget cannot hold, ComfyUI's own OOM fallback tiles the
    decode; the result equals the unpatched tiled decode that fallback runs."""
    from vramcut_core import Engine, EngineConfig

    g = torch.Generator().manual_seed(1)
    big = torch.randn(1, 4, 96, 96, generator=g)
    tile = torch.randn(1, 4, 64, 64, generator=g)

    def act(x):
        e = Engine(vae.first_stage_model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
        with torch.no_grad():
            e.run(vae.first_stage_model.decode, x.to(vae.vae_dtype))
        return e.last_plan.activation_reserve_bytes

    a_big, a_tile = act(big), act(tile)
    assert a_big > 1.5 * a_tile
    from vramcut_core import find_units
    w = find_units(vae.first_stage_model).weight_bytes
    budget = (w + (a_big + a_tile) // 2) / GIB  # holds a tile's activations, not the whole image's
    (_, _, pv), payload = max_vram(budget, vae=vae)
    out = pv.decode(big)
    ref = vae.decode_tiled_(big).to(vae.output_device).movedim(1, -1)
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------------------
# Upscale model and CLIP vision


def _node_extras(pack, gb, **inputs):
    out, ui = run_node(pack, "VRAMCutMaxVRAMExtras", "9", max_vram_gb=gb, budget_mode="fixed", reserve_gb=1.0,
                       prefetch=True, residency=True, **inputs)
    return out, ui["vramcut"][0]


def test_upscale_model_matches_unpatched(comfy, pack):
    from comfy_extras.nodes_upscale_model import ImageUpscaleWithModel

    up = tm.load_tiny_esrgan(seed=0)

    def run(model, image):
        if hasattr(ImageUpscaleWithModel, "define_schema"):
            return ImageUpscaleWithModel.execute(model, image).result[0]
        return ImageUpscaleWithModel().upscale(model, image)[0]

    image = torch.rand(1, 24, 24, 3, generator=torch.Generator().manual_seed(0))
    ref = run(up, image)
    snap = params_snapshot(up.model)
    (pu, _), payload = _node_extras(pack, budget_gb_for(up.model, margin=8 << 20), upscale_model=up)
    out = run(pu, image)
    assert torch.equal(out, ref)
    assert entry(payload, "UPSCALE_MODEL")["stage"] == "measured"
    # buffers are kept between tiles and given back when the node is done with the model:
    # ComfyUI 0.3.x moves it back to the CPU at the end; newer hosts clean up its patcher
    import inspect
    engines = list(pu._vramcut._engines.values())
    if 'to("cpu")' not in inspect.getsource(ImageUpscaleWithModel):
        pu._vramcut.release()
    assert all(e.executor.device_bytes == 0 for e in engines)
    assert_same(up.model, snap)
    assert torch.equal(run(up, image), ref)


def test_clip_vision_matches_unpatched(comfy, pack):
    cv = tm.load_tiny_clip_vision(seed=0)
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    ref = cv.encode_image(image)
    snap = params_snapshot(cv.model)
    (_, pcv), payload = _node_extras(pack, budget_gb_for(cv.model, margin=8 << 20), clip_vision=cv)
    out = pcv.encode_image(image)
    keys = [k for k in ("last_hidden_state", "image_embeds", "penultimate_hidden_states") if hasattr(ref, k)]
    assert keys
    for k in keys:
        assert torch.equal(getattr(out, k), getattr(ref, k)), k
    assert entry(payload, "CLIP_VISION")["stage"] == "measured"
    assert_same(cv.model, snap)
    assert "forward" not in vars(cv.model)
