"""The newest host's contract: what ComfyUI 0.38 does differently from the hosts these tests run
on (0.33.0, 0.3.64), and that the adapter copes with each.

No full 0.38 tree can be run here, so each behaviour is written down below as data, read from
the 0.38.1 sources (the files, at the commits listed in ``nodes/host_surface.py``'s
``FILE_COMMITS``): the signature and what the host does, in words. Each test puts a stand-in for
that behaviour on the host it runs on (a patcher subclass, a replaced host method calling the
original, a node's call order) and checks the patched object against the unpatched one. The
model compiler (``comfy.model_prefetch``) has its own file: ``test_compiler.py``. When a 0.38
tree can be run, the same tests run there with the host's own behaviour and the stand-ins
become no-ops where the host already does what they do.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import tiny_models as tm
from newest_host import newest_patcher_class as _newest_patcher_class

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Behaviour:
    source: str       # the 0.38 file it was read from
    signature: str
    does: str


NEWEST = {
    "fast_disk": Behaviour(
        "comfy/model_patcher.py",
        "ModelPatcher.__init__(model, load_device, offload_device, size=0, weight_inplace_update=False, "
        "fast_disk=False); clone(disable_dynamic=False, model_override=None, force_deepcopy=False)",
        "clone() builds the patcher's own class with fast_disk=self.fast_disk by keyword; loaders pass "
        "fast_disk=comfy.storage.state_dict_fast_disk(sd) (CLIP, VAE, upscale models)"),
    "lowvram_shape_changing_patch": Behaviour(
        "comfy/model_patcher.py",
        "ModelPatcher.load(device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False)",
        "a low-VRAM weight whose patches change its shape (comfy.lora.calculate_shape != weight.shape, a "
        "padded 'diff') is merged on the host at load (patch_weight_to_device(key), the original kept in "
        ".backup, the Parameter replaced); 0.33.0 gives it a per-forward LowVramPatch instead"),
    "vae_decode_tiles_by_free_memory": Behaviour(
        "comfy/sd.py",
        "VAE.decode(samples_in, vae_options={})",
        "after loading, when first_stage_model.comfy_decode_estimate_is_reliable and memory_used_decode(...) "
        "exceeds self.patcher.get_free_memory(device), the untiled attempt is skipped: the tiled decode runs "
        "at once (an out-of-memory error raised on purpose, caught by the usual fallback)"),
    "vae_encode_not_video": Behaviour(
        "comfy/sd.py",
        "VAE.encode(pixel_samples, not_video=None)",
        "not_video given by keyword overrides self.not_video for a 3-D VAE (images encoded as frames or as "
        "one image each)"),
    "clip_generate_mtp": Behaviour(
        "comfy/sd.py",
        "CLIP.generate(tokens, do_sample=True, max_length=256, temperature=1.0, top_k=50, top_p=0.95, "
        "min_p=0.0, repetition_penalty=1.0, seed=None, presence_penalty=0.0, mtp=True)",
        "mtp passed on to cond_stage_model.generate"),
    "upscale_to_device": Behaviour(
        "comfy_extras/nodes_upscale_model.py",
        "ImageUpscaleWithModel.execute(upscale_model, image)",
        "load_models_gpu([upscale_model.patcher], memory_required, force_full_load=True), the image moved to "
        "the patcher's load device, then upscale_model.to(device) (again: spandrel models are not comfy ops), "
        "tiles through upscale_model(tile), halving the tile on out-of-memory errors; no move back to the CPU"),
}


def test_every_behaviour_has_a_test():
    tests = {n for n in globals() if n.startswith("test_")}
    assert {f"test_{k}" for k in NEWEST} <= tests


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


def _snapshot(module):
    return {n: (t, t.detach().clone()) for n, t in module.state_dict(keep_vars=True).items()}


def _unchanged(module, snap):
    now = module.state_dict(keep_vars=True)
    return all(now[n] is t and torch.equal(now[n].detach(), v) for n, (t, v) in snap.items())


# -- fast_disk ---------------------------------------------------------------------------------


def test_fast_disk(comfy, pack, max_vram):
    import comfy.model_patcher
    model = tm.load_tiny_sd3(depth=2)
    model.__class__ = _newest_patcher_class()
    model.fast_disk = True
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, (1, 16, 8, 8), steps=2)
    (patched, _, _), payload = max_vram(0.002, model=model)
    assert isinstance(patched, type(model)) and patched.fast_disk is True
    again = patched.clone()
    assert type(again) is type(patched) and again.fast_disk is True, "a clone keeps VRAMCut and fast_disk"
    assert torch.equal(tm.sample(again, pos, neg, (1, 16, 8, 8), steps=2), ref)
    # the adapter's patcher classes never narrow the host's constructor
    host = pack.nodes.patcher
    for cls in (host.VRAMCutModelPatcher, type(patched)):
        assert "__init__" not in vars(cls)
    assert "fast_disk" in inspect.signature(type(patched).__init__).parameters
    assert comfy.model_patcher.ModelPatcher.__init__ is host.VRAMCutModelPatcher.__init__


# -- shape-changing patches in a low-VRAM load --------------------------------------------------


def _changes_shape(patches, weight) -> bool:
    return any(isinstance(p[1], tuple) and p[1][0] == "diff" and len(p[1][1]) > 1 and p[1][1][1].get("pad_weight")
               and p[1][1][0].shape != weight.shape for p in patches)


def _newest_load(monkeypatch):
    """ModelPatcher.load as NEWEST["lowvram_shape_changing_patch"] says: after the host's own
    load, each low-VRAM weight whose patches change its shape is merged on the host instead of
    patched per forward."""
    import comfy.model_patcher
    import comfy.utils
    MP = comfy.model_patcher.ModelPatcher
    orig = MP.load

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kw):
        out = orig(self, device_to, lowvram_model_memory=lowvram_model_memory,
                   force_patch_weights=force_patch_weights, full_load=full_load, **kw)
        for key, patches in list(self.patches.items()):
            weight, _, _ = comfy.model_patcher.get_key_weight(self.model, key)
            module = comfy.utils.get_attr(self.model, key.rsplit(".", 1)[0])
            param = key.rsplit(".", 1)[1]
            fns = getattr(module, f"{param}_function", None)
            if fns and any(isinstance(f, comfy.model_patcher.LowVramPatch) for f in fns) \
                    and _changes_shape(patches, weight):
                setattr(module, f"{param}_function",
                        [f for f in fns if not isinstance(f, comfy.model_patcher.LowVramPatch)])
                self.patch_weight_to_device(key)
        return out

    monkeypatch.setattr(MP, "load", load)


@pytest.mark.parametrize("load", ["this_host", "newest"])
def test_lowvram_shape_changing_patch(comfy, max_vram, monkeypatch, load):
    """A padded token table (a 'diff' patch larger than the weight): the padded weight is never
    merged into the device copy of the original's shape; the host pads it, per forward (0.33.0)
    or at load into ``.backup`` (0.38). The output is the unpatched model's with the same patch."""
    import comfy.model_management
    import comfy.utils
    if load == "newest":
        _newest_load(monkeypatch)
    c = tm.load_tiny_clip_l(seed=0)
    key = next(k for k in c.cond_stage_model.state_dict() if k.endswith("token_embedding.weight"))
    w = comfy.utils.get_attr(c.cond_stage_model, key)
    diff = torch.randn(w.shape[0] + 8, w.shape[1], generator=torch.Generator().manual_seed(3)) * 0.1
    patch = {key: ("diff", (diff, {"pad_weight": True}))}
    tokens = c.tokenize("a cat on a red chair")
    snap = _snapshot(c.cond_stage_model)

    ref_clip = c.clone()
    ref_clip.add_patches(patch, 1.0)
    ref = ref_clip.encode_from_tokens(tokens, return_pooled=True)
    plain = c.encode_from_tokens(tokens, return_pooled=True)
    assert not torch.equal(ref[0], plain[0]), "the patch changes the output"

    lora_clip = c.clone()
    lora_clip.add_patches(patch, 1.0)
    (_, patched, _), payload = max_vram(0.03, clip=lora_clip)
    out = patched.encode_from_tokens(tokens, return_pooled=True)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert next(e for e in payload["models"] if e["kind"] == "CLIP")["stage"] == "measured"
    assert key not in patched.patcher._vramcut_merge_keys
    if load == "newest":
        assert key in patched.patcher.backup, "0.38 merged it on the host, the original in .backup"
    comfy.model_management.unload_all_models()
    # (the host's unpatching puts a merged weight's original back as a new Parameter: values count)
    now = c.cond_stage_model.state_dict(keep_vars=True)
    changed = [n for n, (t, v) in snap.items() if not torch.equal(now[n].detach(), v)]
    assert not changed, f"the user's model is as it was: {changed}"
    assert torch.equal(c.encode_from_tokens(tokens, return_pooled=True)[0], plain[0])


# -- VAE -----------------------------------------------------------------------------------------


def test_vae_decode_tiles_by_free_memory(comfy, max_vram, monkeypatch):
    """A VAE whose estimate is reliable and larger than the free memory the patcher reports goes
    straight to the tiled decode: the patched VAE runs that tiled decode segmented, and asks its
    free memory of its own patcher (which adds what the engines hold)."""
    import comfy.model_management
    import comfy.sd
    orig = comfy.sd.VAE.decode
    asked = []

    def decode(self, samples_in, vae_options={}):
        if getattr(self.first_stage_model, "comfy_decode_estimate_is_reliable", False):
            ask = getattr(self.patcher, "get_free_memory", None)   # every 0.38 patcher has it
            free = ask(self.device) if ask is not None else comfy.model_management.get_free_memory(self.device)
            asked.append(type(self.patcher).__name__)
            if self.memory_used_decode(samples_in.shape, self.vae_dtype) > free:
                return self.decode_tiled(samples_in, tile_x=8, tile_y=8, overlap=2)
        return orig(self, samples_in, **({"vae_options": vae_options} if vae_options else {}))

    monkeypatch.setattr(comfy.sd.VAE, "decode", decode)
    vae = tm.load_tiny_vae(seed=0)
    vae.first_stage_model.comfy_decode_estimate_is_reliable = True
    vae.memory_used_decode = lambda shape, dtype: 1 << 60   # more than any device has
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    ref = vae.decode(latent)
    (_, _, patched), payload = max_vram(0.004, vae=vae)
    out = patched.decode(latent)
    assert torch.equal(out, ref)
    assert asked[-1].startswith("VRAMCut"), "the host asks the patched VAE's own patcher"
    entry = next(e for e in payload["models"] if e["kind"] == "VAE")
    forwards = sum(e.stats.forwards for e in patched._vramcut._engines.values())
    assert entry["stage"] == "measured" and forwards > 1, "each tile ran in the engine"
    assert "comfy_decode_estimate_is_reliable" in vars(patched.first_stage_model)


def test_vae_encode_not_video(comfy, max_vram, monkeypatch):
    import comfy.sd
    orig = comfy.sd.VAE.encode
    seen = []

    def encode(self, pixel_samples, not_video=None):
        seen.append(not_video)
        return orig(self, pixel_samples)

    monkeypatch.setattr(comfy.sd.VAE, "encode", encode)
    vae = tm.load_tiny_vae(seed=0)
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    ref = vae.encode(image, not_video=True)
    (_, _, patched), payload = max_vram(0.01, vae=vae)
    assert torch.equal(patched.encode(image, not_video=True), ref)
    assert seen == [True, True], "the keyword reaches the host's encode"
    assert next(e for e in payload["models"] if e["kind"] == "VAE")["stage"] == "measured"


# -- CLIP.generate -----------------------------------------------------------------------------


def test_clip_generate_mtp(comfy, max_vram, monkeypatch):
    import comfy.sd
    if not hasattr(comfy.sd.CLIP, "generate"):
        pytest.skip("this host has no text generation (CLIP.generate); the adapter defines none there")
    seen = []

    def generate(self, tokens, do_sample=True, max_length=256, temperature=1.0, top_k=50, top_p=0.95, min_p=0.0,
                 repetition_penalty=1.0, seed=None, presence_penalty=0.0, mtp=True):
        seen.append(mtp)
        return [1, 2, 3]

    monkeypatch.setattr(comfy.sd.CLIP, "generate", generate)
    (_, patched, _), payload = max_vram(0.01, clip=tm.load_tiny_clip_l(seed=0))
    assert patched.generate({"l": []}, mtp=False) == [1, 2, 3] and seen == [False]
    assert patched.generate({"l": []}, max_length=4) == [1, 2, 3] and seen == [False, True]
    assert "CLIP.generate" in payload["message"]


# -- upscale models ------------------------------------------------------------------------------


def _upscale_as_newest(upscale_model, image):
    """The node's calls in NEWEST["upscale_to_device"]'s order."""
    import comfy.model_management as mm
    import comfy.utils
    patcher = getattr(upscale_model, "patcher", None)   # (0.3.64's upscale models have none)
    device = patcher.load_device if patcher is not None else mm.get_torch_device()
    if patcher is not None:
        mm.load_models_gpu([patcher], memory_required=1 << 20, force_full_load=True)
    in_img = image.movedim(-1, -3).to(device)
    upscale_model.to(device)
    s = comfy.utils.tiled_scale(in_img, lambda a: upscale_model(a.float()), tile_x=16, tile_y=16, overlap=4,
                                upscale_amount=upscale_model.scale, output_device=mm.intermediate_device())
    return torch.clamp(s.movedim(-3, -1), min=0, max=1.0)


def test_upscale_to_device(comfy, pack):
    from pack_nodes import run_node
    up = tm.load_tiny_esrgan(seed=0)
    image = torch.rand(1, 24, 24, 3, generator=torch.Generator().manual_seed(0))
    ref = _upscale_as_newest(up, image)
    snap = _snapshot(up.model)
    us = pack.vramcut_core.find_units(up.model)
    out, ui = run_node(pack, "VRAMCutMaxVRAMExtras", "9", max_vram_gb=(us.weight_bytes * 0.6 + (8 << 20)) / GIB,
                       budget_mode="fixed", reserve_gb=1.0, prefetch=True, residency=True, upscale_model=up)
    patched = out[0]
    outs = [_upscale_as_newest(patched, image) for _ in range(2)]   # .to(device) before each run
    assert all(torch.equal(o, ref) for o in outs)
    assert next(e for e in ui["vramcut"][0]["models"] if e["kind"] == "UPSCALE_MODEL")["stage"] == "measured"
    assert all(p.device.type == "cpu" for p in up.model.parameters()), "the weights stay on the host"
    patched._vramcut.release()   # the host's cleanup or detach of the patcher
    assert all(e.executor.device_bytes == 0 for e in patched._vramcut._engines.values())
    assert _unchanged(up.model, snap)
