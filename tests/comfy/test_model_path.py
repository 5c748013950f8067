"""MODEL path: tiny models loaded through ComfyUI's own loaders sample through KSampler with and
without VRAMCut, and the latents match bit for bit (CPU, deterministic kernels)."""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from unit_checks import assert_peak_within_budget

GIB = 1 << 30


def snapshot(module):
    return {n: (t, t.device, t.detach().clone()) for n, t in
            list(module.named_parameters()) + list(module.named_buffers())}


def assert_same(module, snap):
    now = dict(list(module.named_parameters()) + list(module.named_buffers()))
    assert set(now) == set(snap)
    for n, (t, dev, vals) in snap.items():
        assert now[n] is t and now[n].device == dev and torch.equal(now[n].detach(), vals), n


def budget_gb(model, share=0.45):
    """A budget below the diffusion model's weights that still holds the largest unit resident,
    a window of two of the next largest, and the tiny models' activations (well under 1 MiB)."""
    from vramcut_core import find_units
    us = find_units(model.model.diffusion_model)
    sizes = sorted((u.weight_bytes for u in us.units), reverse=True)
    return max(us.weight_bytes * share, sizes[0] + 2.2 * sizes[1] + (1 << 20)) / GIB


def run_node(cls, **inputs):
    """First output of a ComfyUI node, V1 or V3 style, called with inputs by name."""
    if hasattr(cls, "define_schema"):
        return cls.execute(**inputs).result[0]
    return getattr(cls(), cls.FUNCTION)(**inputs)[0]


FAMILIES = {
    "sd3": dict(load=lambda: tm.load_tiny_sd3(depth=4), cond=tm.tiny_sd3_conditioning, latent=(1, 16, 8, 8)),
    "wan21": dict(load=lambda: tm.load_tiny_wan21(num_layers=4), cond=tm.tiny_wan_conditioning,
                  latent=(1, 16, 3, 8, 8)),
}


@pytest.fixture(params=list(FAMILIES), scope="module")
def family(request, comfy):
    spec = FAMILIES[request.param]
    model = spec["load"]()
    pos, neg = spec["cond"]()
    return request.param, model, pos, neg, spec["latent"]


def test_sampling_matches_unpatched_and_original_is_unchanged(family, max_vram, pack):
    name, model, pos, neg, latent = family
    ref = tm.sample(model, pos, neg, latent, steps=3)
    snap = snapshot(model.model.diffusion_model)
    (patched, _, _), payload = max_vram(budget_gb(model), model=model)
    assert patched is not model and patched.model is model.model
    entry = payload["models"][0]
    assert entry["kind"] == "MODEL" and entry["stage"] == "weights"
    out = tm.sample(patched, pos, neg, latent, steps=3)
    assert torch.equal(out, ref), f"{name}: max diff {(out - ref).abs().max()}"
    # the payload the node returned was updated with the measured plan for the real latent
    entry = payload["models"][0]
    assert entry["stage"] == "measured" and entry["plan"]["measured"]
    assert entry["plan"]["streamed_bytes_per_forward"] > 0
    # transfers per forward go to the node beside the bytes (the table, the plan, the cost)
    streamed = [s for s in entry["plan"]["segments"] if not s["resident"] and not s["idle"]]
    assert entry["plan"]["transfers_per_forward"] >= len(streamed) > 0
    assert entry["plan"]["cost"]["transfers_per_forward"] == entry["plan"]["transfers_per_forward"]
    assert " copies" in entry["text"] or " copy " in entry["text"]
    assert entry["plan"]["peak_bytes"] <= entry["plan"]["budget_bytes"]
    assert_peak_within_budget(entry["plan"])
    assert_same(model.model.diffusion_model, snap)
    # the original still samples as before, and carries no VRAMCut wrapper
    assert torch.equal(tm.sample(model, pos, neg, latent, steps=3), ref)
    assert "vramcut" not in str(model.wrappers)
    state = pack.nodes.patcher.state_of(patched)
    assert state is not None and not state.running
    for e in state._engines.values():
        assert e.executor.device_bytes == 0, "device buffers must be released after sampling"


def test_plan_is_measured_once_per_shape_and_cached_for_the_run(family, max_vram, pack):
    name, model, pos, neg, latent = family
    (patched, _, _), payload = max_vram(budget_gb(model), model=model)
    tm.sample(patched, pos, neg, latent, steps=4)
    state = pack.nodes.patcher.state_of(patched)
    (engine,) = state._engines.values()
    assert len(engine.shapes.plans()) == 1, "one plan for one latent shape (cond and uncond batched)"
    # at the end of sampling the node shows what the run did
    stats = payload["models"][0]["plan"]["stats"]
    assert stats["forwards"] >= 4 and stats["bytes_streamed"] >= 4 * payload["models"][0]["plan"]["streamed_bytes_per_forward"] // 2
    assert engine.stats.forwards == 0, "the next run counts its own"


@pytest.mark.parametrize("order", ["lora_then_vramcut", "vramcut_then_lora"])
def test_lora_before_or_after_the_node(order, family, max_vram):
    import comfy.sd

    name, model, pos, neg, latent = family
    lora = tm.tiny_lora_for(model, seed=3)
    with_lora, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)
    ref = tm.sample(with_lora, pos, neg, latent, steps=2)
    plain = tm.sample(model, pos, neg, latent, steps=2)
    assert not torch.equal(ref, plain), "the LoRA must matter"
    if order == "lora_then_vramcut":
        (patched, _, _), _ = max_vram(budget_gb(model), model=with_lora)
    else:
        (p0, _, _), _ = max_vram(budget_gb(model), model=model)
        patched, _ = comfy.sd.load_lora_for_models(p0, None, lora, 1.0, 0)
        assert type(patched) is type(p0), "clones keep the VRAMCut patcher"
    out = tm.sample(patched, pos, neg, latent, steps=2)
    assert torch.equal(out, ref)
    # and the plain model is still plain: no LoRA left merged into the shared weights
    assert torch.equal(tm.sample(model, pos, neg, latent, steps=2), plain)


def test_model_patches_and_block_skips_keep_working(comfy, max_vram):
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3
    from comfy_extras.nodes_slg import SkipLayerGuidanceDiT

    model = tm.load_tiny_sd3(depth=4)
    pos, neg = tm.tiny_sd3_conditioning()

    def patched_chain(m):
        m = run_node(ModelSamplingSD3, model=m, shift=5.0)
        return run_node(SkipLayerGuidanceDiT, model=m, double_layers="1, 2", single_layers="", scale=2.0,
                        start_percent=0.0, end_percent=1.0, rescaling_scale=0.0)

    ref = tm.sample(patched_chain(model), pos, neg, (1, 16, 8, 8), steps=3)
    (vc, _, _), _ = max_vram(budget_gb(model), model=model)
    out = tm.sample(patched_chain(vc), pos, neg, (1, 16, 8, 8), steps=3)
    assert torch.equal(out, ref)
    (vc2, _, _), _ = max_vram(budget_gb(model), model=patched_chain(model))  # patches before the node
    assert torch.equal(tm.sample(vc2, pos, neg, (1, 16, 8, 8), steps=3), ref)


def test_interrupt_mid_sampling_leaves_the_model_usable(comfy, max_vram, pack):
    import comfy.model_management as mm
    import comfy.sample

    model = tm.load_tiny_sd3(depth=4)
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, (1, 16, 8, 8), steps=3)
    snap = snapshot(model.model.diffusion_model)
    (patched, _, _), _ = max_vram(budget_gb(model), model=model)

    def cancel_at_step_1(step, *_):
        if step == 1:
            raise mm.InterruptProcessingException()

    latent = torch.zeros(1, 16, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 0)
    with pytest.raises(mm.InterruptProcessingException):
        comfy.sample.sample(patched, noise, 3, 2.0, "euler", "simple", pos, neg, latent,
                            callback=cancel_at_step_1, disable_pbar=True, seed=0)
    state = pack.nodes.patcher.state_of(patched)
    assert not state.running and not state.in_run
    # the run ended between steps, as any run ends: the module whole again (the device copies
    # stay for the next prompt, which runs exactly)
    assert not any(e.executor.holds_weights for e in state._engines.values())
    assert_same(model.model.diffusion_model, snap)
    assert torch.equal(tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=3), ref)
    assert torch.equal(tm.sample(model, pos, neg, (1, 16, 8, 8), steps=3), ref)


def test_comfyui_is_asked_for_the_budget_not_the_model_size(comfy, max_vram):
    import comfy.model_management as mm

    model = tm.load_tiny_sd3(depth=4)
    gb = budget_gb(model)
    (patched, _, _), _ = max_vram(gb, model=model)
    real = model.model_size()
    assert patched.model_size() <= int(gb * GIB) < real
    lm = mm.LoadedModel(patched)
    assert lm.model_memory_required(patched.load_device) <= int(gb * GIB)
    mm.load_models_gpu([patched])
    try:
        assert patched.model.model_loaded_weight_memory == 0, "ComfyUI must not place weights itself"
        assert patched.model.model_lowvram
    finally:
        mm.unload_all_models()


def test_budget_zero_passes_through_and_bad_values_are_clear(comfy, max_vram, pack):
    model = tm.load_tiny_sd3(depth=2)
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, (1, 16, 8, 8), steps=1)
    (out, _, _), payload = max_vram(0.0, model=model)
    assert out is model and "off" in payload["message"]
    # 0 is off in 'free VRAM minus reserve' too (there a value above 0 caps the budget)
    (out, _, _), payload = max_vram(0.0, model=model, budget_mode="free VRAM minus reserve")
    assert out is model and "off" in payload["message"] and payload["enabled"] is False
    (out, _, _), payload = max_vram(1024.0, model=model, budget_mode="free VRAM minus reserve", reserve_gb=0.0)
    assert out is not model and payload["enabled"] is True
    with pytest.raises(ValueError, match="less than one byte"):
        max_vram(1e-12, model=model, budget_mode="free VRAM minus reserve", reserve_gb=0.0)
    with pytest.raises(ValueError, match="max_vram_gb must not be negative"):
        max_vram(-1.0, model=model)
    with pytest.raises(ValueError, match="max_vram_gb must be a number"):
        max_vram(float("nan"), model=model)
    with pytest.raises(ValueError, match="too small: unit"):
        max_vram(1e-5, model=model)
    assert torch.equal(tm.sample(model, pos, neg, (1, 16, 8, 8), steps=1), ref), "bad values left the model changed"


def test_unknown_model_runs_through_the_generic_fallback_with_a_warning(comfy, max_vram, caplog):
    """A diffusion model no registry entry knows (here: the tiny MMDiT behind a wrapper module)
    still gets units from the generic fallback, samples bit-exact, and says so on the console and
    in the plan."""

    class Unknown(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.dtype = inner.dtype

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    model = tm.load_tiny_sd3(depth=4)
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, (1, 16, 8, 8), steps=2)
    model.model.diffusion_model = Unknown(model.model.diffusion_model)  # a fresh model: nothing shared
    with caplog.at_level("WARNING", logger="vramcut"):
        (patched, _, _), payload = max_vram(budget_gb(model), model=model)
    assert any("generic fallback" in r.getMessage() for r in caplog.records)
    entry = payload["models"][0]
    assert "generic" in entry["label"] and any("generic fallback" in w for w in entry["warnings"])
    assert torch.equal(tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=2), ref)
    assert any("generic fallback" in w for w in payload["models"][0]["plan"]["warnings"])


def test_the_ksampler_node_samples_the_patched_model_bit_exact(family, max_vram):
    """The same through ComfyUI's KSampler node (what a workflow runs), under inference mode."""
    from nodes import KSampler

    name, model, pos, neg, latent = family
    empty = {"samples": torch.zeros(latent)}
    with torch.inference_mode():
        ref = KSampler().sample(model, 7, 3, 2.0, "euler", "simple", pos, neg, empty, denoise=1.0)[0]["samples"]
        (patched, _, _), payload = max_vram(budget_gb(model), model=model)
        out = KSampler().sample(patched, 7, 3, 2.0, "euler", "simple", pos, neg, empty, denoise=1.0)[0]["samples"]
    assert torch.equal(out, ref), name
    assert payload["models"][0]["plan"]["streamed_bytes_per_forward"] > 0
