"""Every input kind of the nodes, patched from a model the host manages with dynamic VRAM.

The host's dynamic patcher does not run on CPU; ``dynamic_host.DynamicStandIn`` does what it
does to everything VRAMCut touches (see that module). For each kind the test checks, against a
reference from the plain (non-dynamic) model:

* nothing raises, whether or not the loader set ``cached_patcher_init``;
* the model is not reloaded (no call to the loader) and the patched model shares every weight
  with the original (same tensors: no second host copy);
* while VRAMCut runs it, no module carries the host's dynamic state (``_v`` & co.), so the
  host's dynamic casts and prefetch leave its weights alone; newer hosts are told the patcher
  is not dynamic (``transformer_options["prefetch_dynamic_vbars"]`` is false);
* the result equals the plain model's bit for bit, LoRA applied before and after the node;
* afterwards the dynamic original gets its module back as it left it (the same ``_v`` objects).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tiny_models as tm
from pack_nodes import run_node

try:
    tm.import_comfy()
except tm.ComfyUINotFound as e:  # pragma: no cover - depends on the host
    pytest.skip(str(e), allow_module_level=True)

import dynamic_host as dh  # noqa: E402  (needs ComfyUI on the path)

GIB = 1 << 30
MARGIN = 4 << 20


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.fixture(autouse=True)
def reloads():
    dh.RELOADS.clear()
    yield dh.RELOADS
    assert dh.RELOADS == [], "a patched dynamic model must never be reloaded from its loader"


def budget_for(module, share=0.5):
    from vramcut_core import find_units
    us = find_units(module)
    sizes = sorted((u.weight_bytes for u in us.units), reverse=True) + [0, 0]
    return (max(us.weight_bytes * share, sizes[0] + 2.2 * sizes[1]) + MARGIN) / GIB


def tensors(module):
    return {n: t for n, t in list(module.named_parameters()) + list(module.named_buffers())}



class DynamicWatch:
    """Records, at every module call inside ``module``, whether any module carries the host's
    dynamic state; and the transformer options the diffusion model was called with."""

    def __init__(self, module):
        self.module, self.seen, self.options = module, [], []
        self._hooks = []

    def __enter__(self):
        def pre(mod, args, kwargs):
            self.seen.extend(dh.dynamic_modules(self.module))
            if "transformer_options" in kwargs:
                self.options.append(kwargs["transformer_options"])
        self._hooks = [self.module.register_forward_pre_hook(pre, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()


def v_objects(module):
    return {n: m.__dict__["_v"] for n, m in module.named_modules() if "_v" in m.__dict__}


def host_loads(patcher, module):
    """The host loads the dynamic model (as an unpatched use of it earlier in the workflow
    would): its ComfyUI-op modules get virtual ranges, the weights of plain torch modules
    (spandrel's upscalers) are force-loaded with a backup of the originals."""
    import comfy.model_management as mm
    mm.load_models_gpu([patcher])
    assert dh.dynamic_modules(module) or patcher.backup, "the stand-in must have loaded the model its way"


def loader_for(build):
    """A stand-in for the host's loader factory (``cached_patcher_init``)."""
    def load(*_a, **_kw):
        return build()
    return load


# ---------------------------------------------------------------------------------------------
# MODEL


@pytest.mark.parametrize("lora", ["none", "before", "after"])
@pytest.mark.parametrize("has_loader", [True, False], ids=["core-loader", "custom-loader"])
def test_model(max_vram, pack, lora, has_loader):
    import comfy.sd

    model = tm.load_tiny_sd3(depth=4, seed=3)
    pristine = tensors(model.model.diffusion_model)
    pos, neg = tm.tiny_sd3_conditioning()
    latent = (1, 16, 8, 8)
    lora_sd = tm.tiny_lora_for(model, seed=7)
    with_lora = lambda m: comfy.sd.load_lora_for_models(m, None, lora_sd, 1.0, 0.0)[0]  # noqa: E731
    ref = tm.sample(with_lora(model) if lora != "none" else model, pos, neg, latent, steps=2)

    dyn = dh.make_dynamic(model, loader_for(lambda: tm.load_tiny_sd3(depth=4, seed=3)) if has_loader else None)
    src = with_lora(dyn) if lora == "before" else dyn
    assert src.is_dynamic()
    host_loads(src, model.model.diffusion_model)
    (patched, _, _), payload = max_vram(budget_for(model.model.diffusion_model), model=src)
    if lora == "after":
        patched = with_lora(patched)
    assert not pack.nodes.patcher.is_dynamic(patched) and patched.model is model.model
    assert type(patched).__name__.startswith("VRAMCut")
    with DynamicWatch(model.model.diffusion_model) as w:
        out = tm.sample(patched, pos, neg, latent, steps=2)
    assert torch.equal(out, ref), f"max diff {(out - ref).abs().max()}"
    assert w.seen == [], f"dynamic state on modules during a VRAMCut forward: {sorted(set(w.seen))[:5]}"
    assert w.options and not any(o.get("prefetch_dynamic_vbars", False) for o in w.options)
    # one host copy: the patched model ran on the very memory the loader filled (a LoRA'd
    # reference run merged into new tensors; loading the patched model put the originals back)
    now = tensors(model.model.diffusion_model)
    assert now.keys() == pristine.keys()
    moved = [n for n, t in pristine.items() if now[n].data_ptr() != t.data_ptr()]
    assert moved == [], moved[:5]
    assert payload["models"][0]["stage"] == "measured"


def test_dynamic_original_gets_its_module_back(max_vram, pack):
    """The host's dynamic state put aside while VRAMCut ran is handed back to the original: the
    same virtual ranges, and the original still counts as the model's only dynamic patcher."""
    import comfy.model_management as mm

    model = tm.load_tiny_sd3(depth=4, seed=4)
    pos, neg = tm.tiny_sd3_conditioning()
    dyn = dh.make_dynamic(model)
    ref = tm.sample(dyn, pos, neg, (1, 16, 8, 8), steps=2)  # the dynamic model loads: _v appears
    v_before = v_objects(model.model.diffusion_model)
    assert v_before, "the stand-in must give the modules virtual ranges"
    (patched, _, _), _ = max_vram(budget_for(model.model.diffusion_model), model=dyn)
    assert model.model.dynamic_patchers == {id(dyn)}, "the patched clone must not count as a dynamic patcher"
    assert torch.equal(tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=2), ref)
    assert torch.equal(tm.sample(dyn, pos, neg, (1, 16, 8, 8), steps=2), ref)
    v_after = v_objects(model.model.diffusion_model)
    assert v_after.keys() == v_before.keys() and all(v_after[k] is v_before[k] for k in v_before)
    mm.unload_all_models()


def test_free_vram_mode_asks_the_host_what_it_could_free(max_vram, pack, monkeypatch):
    """'free VRAM minus reserve' takes the patcher's own answer, which on dynamic hosts counts
    what they could evict from their virtual ranges."""
    import comfy.model_management as mm

    model = tm.load_tiny_sd3(depth=2, seed=5)
    dyn = dh.make_dynamic(model)
    (patched, _, _), _ = max_vram(1024.0, model=dyn, budget_mode="free VRAM minus reserve",
                                  reserve_gb=1.0)  # a cap above any free memory
    (engine,) = pack.nodes.patcher.state_of(patched)._engines.values()
    plain_budget = mm.get_free_memory(patched.load_device) - GIB
    # the device's free memory moves a little between the two readings; the stand-in adds 3 GiB
    assert abs(engine.config.budget_bytes - (plain_budget + dh.RECLAIMABLE)) < GIB // 2
    # the budget is what is free when the model first runs, not when the node ran
    monkeypatch.setattr(dh, "RECLAIMABLE", 6 << 30)
    pos, neg = tm.tiny_sd3_conditioning()
    tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=1)
    plain_budget = mm.get_free_memory(patched.load_device) - GIB
    assert abs(engine.config.budget_bytes - (plain_budget + (6 << 30))) < GIB // 2


# ---------------------------------------------------------------------------------------------
# CLIP, VAE (SD, TAESD, pixel space), upscale model, CLIP vision


@pytest.mark.parametrize("lora", ["none", "before", "after"])
def test_clip(max_vram, pack, lora):
    import comfy.sd

    clip = tm.load_tiny_clip_l(seed=2)
    tokens = clip.tokenize("a dog on the beach at sunset")
    lora_sd = tm.tiny_lora_for(clip.cond_stage_model.state_dict(), seed=5, prefix="text_encoders.")
    with_lora = lambda c: comfy.sd.load_lora_for_models(None, c, lora_sd, 0.0, 1.0)[1]  # noqa: E731
    ref = (with_lora(clip) if lora != "none" else clip).encode_from_tokens(tokens, return_pooled=True)

    dyn = clip.clone()
    dyn.patcher = dh.make_dynamic(clip.patcher, loader_for(lambda: tm.load_tiny_clip_l(seed=2).patcher))
    if lora == "before":
        dyn = with_lora(dyn)
    host_loads(dyn.patcher, clip.cond_stage_model)
    (_, patched, _), payload = max_vram(budget_for(clip.cond_stage_model), clip=dyn)
    if lora == "after":
        patched = with_lora(patched)
    assert type(patched).__name__ == "VRAMCutCLIP" and not pack.nodes.patcher.is_dynamic(patched.patcher)
    with DynamicWatch(clip.cond_stage_model) as w:
        out = patched.encode_from_tokens(tokens, return_pooled=True)
    assert w.seen == []
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert payload["models"][0]["stage"] == "measured"


def tiny_taesd():
    import comfy.sd
    import comfy.taesd.taesd
    sd = tm._module_state_dict(comfy.taesd.taesd.TAESD(latent_channels=4), seed=0, gain=0.5)
    return comfy.sd.VAE(sd=sd)


def pixel_space_vae():
    import comfy.sd
    return comfy.sd.VAE(sd={"pixel_space_vae": torch.tensor(1.0)})


VAES = {"sd": lambda: tm.load_tiny_vae(seed=0), "taesd": tiny_taesd, "pixel_space": pixel_space_vae}


@pytest.mark.parametrize("kind", list(VAES))
def test_vae(max_vram, pack, kind):
    vae = VAES[kind]()
    g = torch.Generator().manual_seed(0)
    image = torch.rand(1, 64, 64, 3, generator=g)
    latent = vae.encode(image)
    ref = (vae.decode(latent), vae.encode(image))

    dyn = copy.copy(vae)
    dyn.patcher = dh.make_dynamic(vae.patcher)  # VAE loaders set no cached_patcher_init for these
    if kind != "pixel_space":  # a VAE without weights has nothing for the host to manage
        host_loads(dyn.patcher, vae.first_stage_model)
    gb = budget_for(vae.first_stage_model) if any(True for _ in vae.first_stage_model.parameters()) else 0.01
    (_, _, patched), _ = max_vram(gb, vae=dyn)
    assert type(patched).__name__ == "VRAMCutVAE" and not pack.nodes.patcher.is_dynamic(patched.patcher)
    with DynamicWatch(vae.first_stage_model) as w:
        out = (patched.decode(latent), patched.encode(image))
    assert w.seen == []
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_upscale_model(pack):
    from comfy_extras.nodes_upscale_model import ImageUpscaleWithModel

    up = tm.load_tiny_esrgan(seed=0)
    image = torch.rand(1, 24, 24, 3, generator=torch.Generator().manual_seed(0))
    run = lambda m: ImageUpscaleWithModel().upscale(m, image)[0]  # noqa: E731
    ref = run(up)
    dyn = copy.copy(up)
    dyn.patcher = dh.make_dynamic(getattr(up, "patcher", None) or pack.nodes.patcher.plain_patcher(up.model))
    host_loads(dyn.patcher, up.model)
    out, _ = run_node(pack, "VRAMCutMaxVRAMExtras", "9", max_vram_gb=budget_for(up.model), budget_mode="fixed",
                      reserve_gb=1.0, prefetch=True, residency=True, upscale_model=dyn)
    patched = out[0]
    assert not pack.nodes.patcher.is_dynamic(patched.patcher)
    with DynamicWatch(up.model) as w:
        out = run(patched)
    assert w.seen == []
    assert torch.equal(out, ref)


def test_clip_vision(pack):
    cv = tm.load_tiny_clip_vision(seed=0)
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    ref = cv.encode_image(image)
    dyn = copy.copy(cv)
    dyn.patcher = dh.make_dynamic(cv.patcher)
    host_loads(dyn.patcher, cv.model)
    out, _ = run_node(pack, "VRAMCutMaxVRAMExtras", "9", max_vram_gb=budget_for(cv.model), budget_mode="fixed",
                      reserve_gb=1.0, prefetch=True, residency=True, clip_vision=dyn)
    patched = out[1]
    assert not pack.nodes.patcher.is_dynamic(patched.patcher)
    with DynamicWatch(cv.model) as w:
        out = patched.encode_image(image)
    assert w.seen == []
    for k in ("image_embeds", "last_hidden_state"):
        assert torch.equal(out[k], ref[k]), k
