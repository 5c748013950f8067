"""Smoke tests for tests/tiny_models.py: every tiny model builds through ComfyUI's own loaders
and runs once on CPU (finite output of the expected shape); the LoRA changes the output."""
import os
import sys

import pytest
import torch

import tiny_models as tm  # tests/ is on sys.path (tests/conftest.py)

try:
    COMFYUI = tm.import_comfy()
except tm.ComfyUINotFound as e:  # pragma: no cover - depends on the host
    pytest.skip(str(e), allow_module_level=True)

import comfy.model_detection  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with tm.torch_threads(1):  # tiny models: threads only add waits on a busy host
        yield


def _finite(t):
    return bool(torch.isfinite(t).all())


def _n_params(sd):
    return sum(v.numel() for v in sd.values())


# ---------------------------------------------------------------------------------------------

def test_import_comfy_is_idempotent_and_on_cpu():
    assert tm.import_comfy() == COMFYUI == tm.comfyui_path()
    assert sys.path.count(COMFYUI) == 1
    from comfy.cli_args import args
    assert args.cpu is True
    assert comfy.model_management.get_torch_device().type == "cpu"
    assert os.path.join(COMFYUI, "comfy") in [os.path.abspath(p) for p in sys.modules["comfy"].__path__]


def test_comfyui_path_env_and_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("COMFYUI_PATH", COMFYUI)
    assert tm.comfyui_path() == COMFYUI
    # a $COMFYUI_PATH that holds no ComfyUI is not second-guessed, even with one at the default
    monkeypatch.setenv("HOME", str(tmp_path))
    fake = tmp_path / "comfy" / "ComfyUI" / "comfy"
    fake.mkdir(parents=True)
    (fake / "model_management.py").write_text("")
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "nope"))
    assert tm.comfyui_path() is None
    # unset: comfy-cli's default location
    monkeypatch.delenv("COMFYUI_PATH")
    assert tm.comfyui_path() == str(tmp_path / "comfy" / "ComfyUI")


# --------------------------------------------------------------------------------------------- SD3

def test_sd3_weights_are_seeded_and_detected():
    sd = tm.tiny_sd3_state_dict(depth=2, seed=0)
    again = tm.tiny_sd3_state_dict(depth=2, seed=0)
    other = tm.tiny_sd3_state_dict(depth=2, seed=1)
    assert sd.keys() == again.keys() and all(torch.equal(sd[k], again[k]) for k in sd)
    assert not torch.equal(sd["x_embedder.proj.weight"], other["x_embedder.proj.weight"])
    assert 0.8e6 < _n_params(sd) < 1.5e6
    cfg = comfy.model_detection.detect_unet_config(sd, "")
    expected = tm.tiny_sd3_config(depth=2)
    for k, v in expected.items():
        assert cfg[k] == v, k
    mc = comfy.model_detection.model_config_from_unet(sd, "")
    assert type(mc).__name__ == "SD3"


def test_sd3_loads_and_samples():
    model, sd = tm.load_tiny_sd3(depth=2, seed=0, return_state_dict=True)
    assert type(model).__name__ == "ModelPatcher"
    assert type(model.model).__name__ == "SD3"
    assert model.model.get_dtype() == torch.float32
    dm = model.model.diffusion_model
    assert dm.hidden_size == 128 and dm.num_heads == 2 and len(dm.joint_blocks) == 2
    # the loader popped its copy, not ours
    assert "x_embedder.proj.weight" in sd
    assert torch.equal(dm.x_embedder.proj.weight.detach(), sd["x_embedder.proj.weight"])

    pos, neg = tm.tiny_sd3_conditioning(seed=0)
    assert pos[0][0].shape == (1, 8, 32) and pos[0][1]["pooled_output"].shape == (1, 32)
    out = tm.sample(model, pos, neg, tm.SD3_LATENT_SHAPE, steps=2, seed=0)
    assert out.shape == tm.SD3_LATENT_SHAPE and _finite(out)
    assert torch.equal(out, tm.sample(model, pos, neg, tm.SD3_LATENT_SHAPE, steps=2, seed=0))
    assert not torch.equal(out, tm.sample(model, pos, neg, tm.SD3_LATENT_SHAPE, steps=2, seed=1))


def test_sd3_through_common_ksampler():
    import nodes
    model = tm.load_tiny_sd3(seed=0)
    pos, neg = tm.tiny_sd3_conditioning(seed=0)
    latent = {"samples": torch.zeros(1, 4, 8, 8)}  # EmptyLatentImage shape; widened to 16 channels
    (out,) = nodes.common_ksampler(model, 0, 2, 3.0, "euler", "simple", pos, neg, latent)
    assert out["samples"].shape == (1, 16, 8, 8) and _finite(out["samples"])


def test_sd3_context_dim_1024():
    model = tm.load_tiny_sd3(seed=0, context_dim=1024)
    assert model.model.diffusion_model.context_embedder.in_features == 1024
    pos, neg = tm.tiny_sd3_conditioning(seed=0, context_dim=1024, tokens=77)
    out = tm.sample(model, pos, neg, tm.SD3_LATENT_SHAPE, steps=2, seed=0)
    assert out.shape == tm.SD3_LATENT_SHAPE and _finite(out)
    # SD3 needs a pooled vector: LotusConditioning-style `{}` options fail (documented)
    with pytest.raises(KeyError):
        tm.sample(model, [[pos[0][0], {}]], [[neg[0][0], {}]], tm.SD3_LATENT_SHAPE, steps=1, seed=0)


# --------------------------------------------------------------------------------------------- Wan

def test_wan21_loads_and_samples():
    model, sd = tm.load_tiny_wan21(seed=0, return_state_dict=True)
    assert type(model.model).__name__ == "WAN21"
    assert type(model.model.model_config).__name__ == "WAN21_T2V"
    dm = model.model.diffusion_model
    assert dm.dim == 128 and dm.num_heads == 1 and len(dm.blocks) == 2
    assert _n_params(sd) < 1.5e6
    pos, neg = tm.tiny_wan_conditioning(seed=0)
    assert pos[0][0].shape == (1, 8, tm.WAN_TEXT_DIM)
    out = tm.sample(model, pos, neg, tm.WAN_LATENT_SHAPE, steps=2, seed=0)
    assert out.shape == tm.WAN_LATENT_SHAPE and _finite(out)
    assert torch.equal(out, tm.sample(model, pos, neg, tm.WAN_LATENT_SHAPE, steps=2, seed=0))


# --------------------------------------------------------------------------------------------- text

def test_clip_l_encodes():
    clip, sd = tm.load_tiny_clip_l(seed=0, return_state_dict=True)
    assert isinstance(clip, comfy.sd.CLIP)
    assert sd["text_model.embeddings.token_embedding.weight"].shape == (49408, 32)
    tr = clip.cond_stage_model.clip_l.transformer
    assert tr.num_layers == 2
    w = tr.text_model.embeddings.token_embedding.weight.detach()
    assert w.dtype == comfy.model_management.text_encoder_dtype()  # ComfyUI's default (fp16 on CPU)
    assert torch.equal(w, sd["text_model.embeddings.token_embedding.weight"].to(w.dtype))
    cond, pooled = clip.encode_from_tokens(clip.tokenize("a photo of a cat"), return_pooled=True)
    assert cond.shape == (1, 77, 32) and pooled.shape == (1, 32)
    assert _finite(cond) and _finite(pooled)
    again, _ = tm.load_tiny_clip_l(seed=0).encode_from_tokens(clip.tokenize("a photo of a cat"), return_pooled=True)
    assert torch.equal(cond, again)
    dog = clip.encode_from_tokens(clip.tokenize("a photo of a dog"))
    assert not torch.equal(cond, dog)


def test_clip_l_float32():
    clip = tm.load_tiny_clip_l(seed=0, dtype=torch.float32)
    assert clip.cond_stage_model.clip_l.transformer.text_model.embeddings.token_embedding.weight.dtype == torch.float32
    cond, pooled = clip.encode_from_tokens(clip.tokenize("a photo of a cat"), return_pooled=True)
    half, _ = tm.load_tiny_clip_l(seed=0).encode_from_tokens(clip.tokenize("a photo of a cat"), return_pooled=True)
    assert _finite(cond) and torch.allclose(cond, half.float(), atol=5e-2)


def test_t5_encodes():
    t5, sd = tm.load_tiny_t5(seed=0, return_state_dict=True)
    assert isinstance(t5, comfy.sd.CLIP)
    assert comfy.sd.detect_te_model(sd) == comfy.sd.TEModel.T5_BASE
    tr = t5.cond_stage_model.t5base.transformer
    assert tr.num_layers == 2 and tr.shared.weight.shape == (32128, 32)
    cond, pooled = t5.encode_from_tokens(t5.tokenize("a photo of a cat"), return_pooled=True)
    assert cond.ndim == 3 and cond.shape[0] == 1 and cond.shape[2] == 32 and cond.shape[1] >= 128
    assert _finite(cond)
    dog = t5.encode_from_tokens(t5.tokenize("a photo of a dog"))
    assert not torch.equal(cond, dog)


# --------------------------------------------------------------------------------------------- VAE

def test_vae_decodes_and_encodes():
    vae = tm.load_tiny_vae(seed=0)
    assert isinstance(vae, comfy.sd.VAE) and vae.latent_channels == 4
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 4, 8, 8, generator=g)
    image = torch.rand(1, 64, 64, 3, generator=g)
    # ComfyUI runs nodes under inference mode (encode_tiled needs it)
    with torch.inference_mode():
        img = vae.decode(latent)
        assert img.shape == (1, 64, 64, 3) and _finite(img)
        assert float(img.min()) >= 0.0 and float(img.max()) <= 1.0
        lat = vae.encode(image)
        assert lat.shape == (1, 4, 8, 8) and _finite(lat)
        big = torch.randn(1, 4, 16, 16, generator=g)
        tiled = vae.decode_tiled(big, tile_x=8, tile_y=8, overlap=2)
        assert tiled.shape == (1, 128, 128, 3) and _finite(tiled)
        lat_t = vae.encode_tiled(torch.rand(1, 128, 128, 3, generator=g), tile_x=64, tile_y=64, overlap=16)
        assert lat_t.shape == (1, 4, 16, 16) and _finite(lat_t)


# --------------------------------------------------------------------------------------------- LoRA

def test_lora_changes_sd3_output():
    model, sd = tm.load_tiny_sd3(seed=0, return_state_dict=True)
    lora = tm.tiny_lora_for(sd, seed=0)
    assert lora and all(k.startswith("diffusion_model.") for k in lora)
    assert tm.tiny_lora_for(model, seed=0).keys() == lora.keys()
    n_targets = sum(1 for k in lora if k.endswith(".lora_up.weight"))
    patched, clip = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)
    assert clip is None
    assert len(patched.patches) == n_targets > 0
    pos, neg = tm.tiny_sd3_conditioning(seed=0)
    base = tm.sample(model, pos, neg, tm.SD3_LATENT_SHAPE, steps=2, seed=0)
    with_lora = tm.sample(patched, pos, neg, tm.SD3_LATENT_SHAPE, steps=2, seed=0)
    assert _finite(with_lora)
    assert (base - with_lora).abs().mean() > 1e-3
    # the original patcher is untouched
    assert torch.equal(base, tm.sample(model, pos, neg, tm.SD3_LATENT_SHAPE, steps=2, seed=0))


def test_lora_applies_to_wan():
    model = tm.load_tiny_wan21(seed=0)
    lora = tm.tiny_lora_for(model, seed=0)
    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)
    assert len(patched.patches) == sum(1 for k in lora if k.endswith(".lora_up.weight")) > 0


def test_lora_applies_to_clip():
    clip = tm.load_tiny_clip_l(seed=0)
    lora = tm.tiny_lora_for(clip, seed=0)
    assert all(k.startswith("text_encoders.clip_l.transformer.") for k in lora)
    assert lora.keys() == tm.tiny_lora_for(clip.cond_stage_model.state_dict(), seed=0, prefix="text_encoders.").keys()
    _, patched = comfy.sd.load_lora_for_models(None, clip, lora, 0, 1.0)
    assert len(patched.patcher.patches) == sum(1 for k in lora if k.endswith(".lora_up.weight")) > 0
    tokens = clip.tokenize("a photo of a cat")
    base = clip.encode_from_tokens(tokens)
    out = patched.encode_from_tokens(tokens)
    assert _finite(out) and (base - out).abs().mean() > 1e-3


# --------------------------------------------------------------------------------------------- extras

def test_esrgan_upscales():
    from comfy_extras.nodes_upscale_model import ImageUpscaleWithModel
    from spandrel import ImageModelDescriptor
    up = tm.load_tiny_esrgan(seed=0, scale=2)
    assert isinstance(up, ImageModelDescriptor) and up.scale == 2
    with torch.inference_mode():
        out = ImageUpscaleWithModel.execute(up, torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(0)))
    img = out.result[0]
    assert img.shape == (1, 32, 32, 3) and _finite(img)


def test_clip_vision_encodes():
    cv = tm.load_tiny_clip_vision(seed=0)
    out = cv.encode_image(torch.rand(2, 40, 48, 3, generator=torch.Generator().manual_seed(0)))
    assert out["image_embeds"].shape == (2, 16)
    assert out["last_hidden_state"].shape == (2, 17, 32)
    assert _finite(out["image_embeds"]) and _finite(out["last_hidden_state"])
