"""The plan preview through the Max VRAM node: with a 'Preview shape' connected, each connected
model's plan is traced at that shape before anything runs. For the tiny families built through
ComfyUI's model configs and loaders (SD 1.x, SDXL, Flux, SD3, Qwen-Image, HunyuanVideo 1.0
and 1.5 where the host has it, Wan 2.1, the SD VAE, CLIP-L): the node shows the traced plan marked
"traced" with the shape; the preview copies no weight and runs no forward; the model is
unchanged; the plan the real first run then uses at the same shape is the previewed one (the call
with the same inputs reuses the traced profile, and its output equals the unpatched model's). A
model whose inputs cannot be built, and a budget too small for the shape, are said on the node."""
from __future__ import annotations

import os
import sys

import pytest
import torch

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:  # the family helpers by name, as the sweep imports them
    sys.path.append(_here)

import tiny_models as tm  # noqa: E402
from pack_nodes import run_node  # noqa: E402

GIB = 1 << 30


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode(), tm.torch_threads(1):
        yield


@pytest.fixture
def traces(monkeypatch, pack):
    """Counts the dry runs (the engine's calls of ``trace_units``)."""
    eng_mod = pack.vramcut_core.engine
    calls = []
    orig = eng_mod.trace_units

    def counted(*a, **k):
        calls.append(a[0])
        return orig(*a, **k)

    monkeypatch.setattr(eng_mod, "trace_units", counted)
    return calls


def shape(pack, width, height, frames=1, batch=1, **more):
    (s,), _ = run_node(pack, "VRAMCutPreviewShape", "9", width=width, height=height, frames=frames, batch=batch, **more)
    return s


def engine(pack, obj):
    st = pack.nodes.state.state_of(obj) or pack.nodes.state.state_of(obj.patcher)
    (eng,) = st._engines.values()
    return eng


def tensors(module) -> dict:
    return {k: (t, t.detach().clone()) for k, t in module.state_dict(keep_vars=True).items()}


def assert_unchanged(module, before: dict) -> None:
    now = module.state_dict(keep_vars=True)
    assert now.keys() == before.keys()
    for k, (t, copy) in before.items():
        assert now[k] is t, f"{k} was replaced"
        assert not getattr(t, "_is_fake", False) and t.device.type == "cpu" and torch.equal(t, copy), k


def same_plan(pack, entry_plan: dict, plan) -> None:
    """The node's traced plan and ``plan``: the same units with the same figures, the same segments."""
    real = pack.vramcut_core.plan_to_json(plan)
    for key in ("units", "segments", "peak_bytes", "activation_reserve_bytes", "resident_bytes", "source"):
        assert entry_plan[key] == real[key], key


def previewed(pack, max_vram, gb, slot, model, shp):
    """Apply the node with the shape; the traced entry, the engine, and checks that nothing ran."""
    outs, payload = max_vram(gb, **{slot: model}, preview_shape=shp)
    patched = outs[("model", "clip", "vae").index(slot)]
    assert payload["message"] is None, payload["message"]
    (entry,) = payload["models"]
    model = f"{shp.label} (×2: cond + uncond)" if shp.cfg_batch else f"{shp.label} (CFG 1: one prompt)"
    label = {"model": model, "vae": f"{shp.label} (decode)", "clip": "an empty prompt"}[slot]
    assert entry["stage"] == "traced" and entry["traced_at"] == label
    assert entry["plan"]["source"] == "traced" and entry["plan"]["measured"]
    eng = engine(pack, patched)
    assert eng.stats.forwards == 0 and not eng.measurements and not eng.shapes.plans(), "nothing ran"
    assert eng.executor.device_bytes == 0 and eng.executor.peak_weight_bytes == 0, "no weight was copied"
    return patched, entry, eng


def _budget(pack, max_vram, slot, model, shp) -> float:
    """A budget that streams part of the model at this shape: the traced activation reserve and
    three quarters of the weights."""
    _, payload = max_vram(1.0, **{slot: model}, preview_shape=shp, node_id="8")
    plan = payload["models"][0]["plan"]
    return (plan["activation_reserve_bytes"] + sum(u["weight_bytes"] for u in plan["units"]) * 3 // 4) / GIB


# the sweep's tiny HunyuanVideo, with the 16-channel latents of the host's loader
HUNYUAN = dict(in_channels=16, out_channels=16, vec_in_dim=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
               num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=256, patch_size=[1, 2, 2],
               qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False, use_cond_type_embedding=False,
               vision_in_dim=None, meanflow_sum=False)


def built(family: str):
    """A tiny model of a family with fixed sizes in the host's loader, through the host's own
    model config class (``comfy.supported_models``), seeded, in a plain ModelPatcher."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    from comfy.ldm.flux.model import FluxParams
    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    import test_families as tf

    unet = dict(image_size=32, in_channels=4, model_channels=32, out_channels=4, num_res_blocks=[1, 1],
                channel_mult=[1, 2], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                transformer_depth_middle=1, use_spatial_transformer=True, legacy=False, context_dim=32,
                use_temporal_attention=False, use_temporal_resblock=False, num_head_channels=-1)
    cls, cfg = {
        "BaseModel": (sm.SD15, dict(unet, use_linear_in_transformer=False, adm_in_channels=None)),
        "SDXL": (sm.SDXL, dict(unet, use_linear_in_transformer=True, adm_in_channels=2816, num_classes="sequential")),
        "Flux": (sm.Flux, dict(image_model="flux", **tf.host_kwargs(FluxParams, **dict(tf.FLUX_KW, in_channels=16,
                                                                                       out_channels=16)))),
        "QwenImage": (sm.QwenImage, dict(image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16,
                                         num_layers=2, attention_head_dim=32, num_attention_heads=2,
                                         joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(8, 12, 12))),
        "HunyuanVideo": (sm.HunyuanVideo, dict(image_model="hunyuan_video", **tf.host_kwargs(HunyuanVideoParams,
                                                                                             **HUNYUAN))),
        "HunyuanVideo15": (getattr(sm, "HunyuanVideo15", None),
                           dict(image_model="hunyuan_video", **tf.host_kwargs(
                               HunyuanVideoParams, **dict(HUNYUAN, in_channels=65, out_channels=32, vec_in_dim=None)))),
    }[family]
    if cls is None:
        pytest.skip(f"this host has no {family} models")
    mc = cls(cfg)
    if family == "SDXL":  # its fixed 64-wide heads are wider than the tiny model's 32 channels
        mc.unet_config["num_head_channels"] = 16
    model = mc.get_model({}, device="cpu")
    tf.seeded(model.diffusion_model)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def _cond(tokens: int, width: int, pooled: int | None = None):
    g = torch.Generator().manual_seed(0)

    def one():
        return [[torch.randn(1, tokens, width, generator=g),
                 {"pooled_output": torch.randn(1, pooled, generator=g) if pooled else None}]]
    return one(), one()


MODELS = {
    # family: (loader, sampler conditioning at the family's token count, latent, pixels (w, h, frames))
    "BaseModel": (lambda: built("BaseModel"), lambda: _cond(77, 32), (1, 4, 16, 16), (128, 128, 1)),
    "SDXL": (lambda: built("SDXL"), lambda: _cond(77, 32, 1280), (1, 4, 16, 16), (128, 128, 1)),
    "Flux": (lambda: built("Flux"), lambda: _cond(256, 32, 16), (1, 16, 16, 16), (128, 128, 1)),
    "SD3": (lambda: tm.load_tiny_sd3(), lambda: tm.tiny_sd3_conditioning(tokens=154), (1, 16, 16, 16), (128, 128, 1)),
    "QwenImage": (lambda: built("QwenImage"), lambda: _cond(256, 32), (1, 16, 1, 16, 16), (128, 128, 1)),
    "HunyuanVideo": (lambda: built("HunyuanVideo"), lambda: _cond(256, 32, 16), (1, 16, 2, 8, 8), (64, 64, 5)),
    "HunyuanVideo15": (lambda: built("HunyuanVideo15"), lambda: _cond(256, 32), (1, 32, 2, 4, 4), (64, 64, 5)),
    "WAN21": (lambda: tm.load_tiny_wan21(), lambda: tm.tiny_wan_conditioning(tokens=512), (1, 16, 2, 8, 8),
              (64, 64, 5)),
}


@pytest.mark.parametrize("family,cfg", [(f, 2.0) for f in sorted(MODELS)] + [("BaseModel", 1.0)])
def test_model_preview_is_the_plan_the_first_run_uses(comfy, pack, max_vram, traces, family, cfg):
    """By default the preview is the call a sampler with CFG above 1 makes (the positive and the
    negative prompt in one call of twice the batch); with cfg_batch off, the call of CFG 1."""
    load, conditioning, latent, (w, h, f) = MODELS[family]
    model = load()
    assert type(model.model).__name__ == family
    shp = shape(pack, w, h, f) if cfg > 1 else shape(pack, w, h, f, cfg_batch=False)
    assert shp.cfg_batch == (cfg > 1)
    gb = _budget(pack, max_vram, "model", model, shp)
    before = tensors(model.model.diffusion_model)
    patched, entry, eng = previewed(pack, max_vram, gb, "model", model, shp)
    assert any(not s["resident"] for s in entry["plan"]["segments"]), "the budget streams"
    assert_unchanged(model.model.diffusion_model, before)
    (sig,) = eng.traces

    # the call the preview traced, for real: the cached profile is used (no second dry run), the
    # plan it runs is the previewed one, and the output is the unpatched model's
    fn, args, kwargs = pack.nodes.preview._model_call(patched, shp)
    n = len(traces)
    out = fn(*args, **kwargs)
    assert len(traces) == n, "the real call reused the previewed profile"
    same_plan(pack, entry["plan"], eng.planner.measured_plan(dict(eng.traces[sig].measurements), "traced"))
    ref_fn, ref_args, ref_kwargs = pack.nodes.preview._model_call(model, shp)
    assert torch.equal(out, ref_fn(*ref_args, **ref_kwargs))
    assert eng.shapes.plans()[sig].segments == eng.planner.measured_plan(dict(eng.traces[sig].measurements), "traced").segments

    # a sampling run at the same shape: its call also carries the step schedule (steps + 1
    # floats in the transformer options, live through the whole forward), so it is traced again,
    # and every unit's figures are the preview's plus exactly those bytes; the segments are the same
    pos, neg = conditioning()
    outs, _ = max_vram(gb, model=model, node_id="3")
    steps = 1
    tm.sample(outs[0], pos, neg, latent, steps=steps, cfg=cfg)
    eng3 = engine(pack, outs[0])
    (real_sig,) = eng3.traces
    assert [e for e in real_sig if e not in sig] == [("arg5.sample_sigmas", (steps + 1,), "torch.float32")]
    real = pack.vramcut_core.plan_to_json(
        eng3.planner.measured_plan(dict(eng3.traces[real_sig].measurements), "traced"))
    schedule = (steps + 1) * 4
    for a, b in zip(entry["plan"]["units"], real["units"], strict=True):
        assert (b["activation_bytes"] - a["activation_bytes"], b["cut_in_bytes"] - a["cut_in_bytes"]) == \
            ((schedule, schedule) if a["entered"] else (0, 0)), (a, b)
    assert [(s["units"], s["resident"]) for s in entry["plan"]["segments"]] == \
        [(s["units"], s["resident"]) for s in real["segments"]]
    assert_unchanged(model.model.diffusion_model, before)


def test_vae_preview_is_the_plan_the_decode_uses(comfy, pack, max_vram, traces):
    vae = tm.load_tiny_vae(seed=0)
    shp = shape(pack, 128, 128)
    gb = _budget(pack, max_vram, "vae", vae, shp)
    before = tensors(vae.first_stage_model)
    patched, entry, eng = previewed(pack, max_vram, gb, "vae", vae, shp)
    assert_unchanged(vae.first_stage_model, before)
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    ref = vae.decode(latent)
    n = len(traces)
    out = patched.decode(latent)
    assert len(traces) == n, "the decode reused the previewed profile"
    (sig,) = eng.traces
    same_plan(pack, entry["plan"], eng.planner.measured_plan(dict(eng.traces[sig].measurements), "traced"))
    assert torch.equal(out, ref)
    assert_unchanged(vae.first_stage_model, before)


def test_clip_preview_is_the_plan_the_encode_uses(comfy, pack, max_vram, traces):
    clip = tm.load_tiny_clip_l(seed=0)
    shp = shape(pack, 1024, 1024)
    before = tensors(clip.cond_stage_model)
    patched, entry, eng = previewed(pack, max_vram, 1.0, "clip", clip, shp)
    assert_unchanged(clip.cond_stage_model, before)
    tokens = clip.tokenize("")
    ref = clip.encode_from_tokens(tokens, return_pooled=True)
    n = len(traces)
    out = patched.encode_from_tokens(tokens, return_pooled=True)
    assert len(traces) == n, "the encode reused the previewed profile"
    (sig,) = eng.traces
    same_plan(pack, entry["plan"], eng.planner.measured_plan(dict(eng.traces[sig].measurements), "traced"))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_a_budget_too_small_for_the_shape_is_shown_with_the_number_and_remembered_nowhere(comfy, pack, max_vram):
    vae = tm.load_tiny_vae(seed=0)
    shp = shape(pack, 128, 128)
    outs, payload = max_vram(2 / 1024, vae=vae, preview_shape=shp)
    assert payload["message_level"] == "error" and "128×128, batch 1" in payload["message"], payload["message"]
    assert payload["min_budget_bytes"] > 2 * (1 << 20) and payload["min_budget_exact"] is True
    (entry,) = payload["models"]
    assert entry["refused"] and entry["stage"] == "weights"
    eng = engine(pack, outs[2])
    assert not eng.shapes.failures() and eng.executor.peak_weight_bytes == 0


def test_image_model_with_frames_is_said_on_the_node(comfy, pack, max_vram):
    model = tm.load_tiny_sd3()
    _, payload = max_vram(1.0, model=model, preview_shape=shape(pack, 128, 128, frames=9))
    assert payload["message_level"] == "notice"
    assert payload["message"] == ("MODEL: no plan preview at 128×128×9 frames, batch 1 (×2: cond + uncond) "
                                  "(an image model (SD3 latents) "
                                  "takes no frames: set frames to 1); the plan shown is the weights estimate")
    assert payload["models"][0]["stage"] == "weights"


def test_a_family_whose_inputs_cannot_be_built_is_said_on_the_node(comfy, pack, max_vram, monkeypatch):
    monkeypatch.delitem(pack.nodes.preview._FAMILIES, "WAN21")
    _, payload = max_vram(1.0, model=tm.load_tiny_wan21(), preview_shape=shape(pack, 64, 64, frames=5))
    assert payload["message_level"] == "notice"
    assert payload["message"].startswith("MODEL: no plan preview at 64×64×5 frames, batch 1 (×2: cond + uncond) "
                                         "(the preview cannot "
                                         "build the inputs of WAN21 models yet"), payload["message"]
    assert payload["models"][0]["stage"] == "weights"


def test_upscale_models_are_not_previewed_and_say_so(comfy, pack):
    model = tm.load_tiny_esrgan(seed=0)
    _, ui = run_node(pack, "VRAMCutMaxVRAMExtras", "1", max_vram_gb=1.0, budget_mode="fixed", reserve_gb=1.0,
                     prefetch=True, residency=True, upscale_model=model, preview_shape=shape(pack, 64, 64))
    payload = ui["vramcut"][0]
    assert "UPSCALE_MODEL: no plan preview at 64×64, batch 1" in payload["message"]
    assert payload["models"][0]["stage"] == "weights"


def test_each_refused_model_carries_its_own_budget_and_the_node_the_largest(comfy, pack, max_vram):
    """A MODEL and a VAE both refused at one budget: each model's entry names its own smallest
    budget, and the node's figure (the banner's and the collapsed title's) is the largest, the
    one budget that makes both fit (each model gets the whole budget in turn)."""
    model, vae = built("BaseModel"), tm.load_tiny_vae(seed=0)
    shp = shape(pack, 128, 128)
    _, payload = max_vram(1 / 1024, model=model, vae=vae, preview_shape=shp)
    entries = {m["kind"]: m for m in payload["models"]}
    assert entries["MODEL"]["refused"] and entries["VAE"]["refused"], payload
    mins = {k: m["min_budget_bytes"] for k, m in entries.items()}
    assert mins["MODEL"] != mins["VAE"], mins
    assert payload["min_budget_bytes"] == max(mins.values()), (payload["min_budget_bytes"], mins)
    assert payload["min_budget_exact"] is all(m["min_budget_exact"] for m in entries.values())
    assert "MODEL" in payload["message"] and "VAE" in payload["message"], payload["message"]
    # each alone at its own figure is not refused
    for kind, slot, obj in (("MODEL", "model", model), ("VAE", "vae", vae)):
        _, alone = max_vram(mins[kind] / GIB + 0.001, **{slot: obj}, preview_shape=shp, node_id="5")
        assert alone["message_level"] != "error", (kind, alone["message"])


def test_the_node_names_a_calls_inputs_as_a_user_knows_them(pack):
    """The engine's signature (tensor paths) read as the user knows the inputs."""
    inputs_text = pack.nodes.report.inputs_text
    sig = (("arg0", (2, 4, 64, 64), "torch.float32"), ("arg1", (2,), "torch.float32"),
           ("c_crossattn", (2, 77, 768), "torch.float32"),
           ("arg5.sample_sigmas", (21,), "torch.float32"))
    assert inputs_text("MODEL", sig) == "latent 64×64, batch 2 · text 77 tokens · 20 steps"
    assert inputs_text("VAE", (("arg0", (1, 4, 64, 64), "torch.float16"),)) == "latent 64×64, batch 1"
    assert inputs_text("VAE", (("arg0", (1, 3, 512, 512), "torch.float16"),)) == "image 512×512, batch 1"
    assert inputs_text("CLIP", (("tokens.l", (1, 77), "tokens"),)) == "text 77 tokens"
    assert "arg" not in inputs_text("MODEL", sig)


def test_a_budget_below_one_block_still_previews_every_model(comfy, pack, max_vram):
    """Below what one block's weights need, with a shape connected: every model is previewed
    and refused with its own smallest budget at that shape (not the weights' lower bound, which
    stopped the node before the others were previewed), the node's figure the largest."""
    model, vae = built("BaseModel"), tm.load_tiny_vae(seed=0)
    shp = shape(pack, 128, 128)
    _, payload = max_vram(1 / (1 << 20), model=model, vae=vae, preview_shape=shp)
    entries = {m["kind"]: m for m in payload["models"]}
    assert set(entries) == {"MODEL", "VAE"}, payload
    assert all(m["refused"] and m["min_budget_exact"] for m in entries.values()), payload
    assert payload["min_budget_bytes"] == max(m["min_budget_bytes"] for m in entries.values())
    assert payload["min_budget_exact"] is True and "at least" not in payload["message"], payload["message"]
    _, alone = max_vram(payload["min_budget_bytes"] / GIB + 0.001, model=model, vae=vae, preview_shape=shp,
                        node_id="6")
    assert alone["message_level"] != "error", alone["message"]
