"""Call paths of newer hosts: each runs segmented under the budget, or the node says plainly
that it runs outside it. Host features are detected by presence; a test of a feature the host
lacks skips and names it."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import tiny_models as tm

GIB = 1 << 30


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


def self_tiling(vae):
    """Give the tiny SD VAE the entry points of a VAE that tiles itself (SeedVR2's
    ``decode_tiled``/``encode_tiled`` on its first-stage model, ``handles_tiling`` on the VAE):
    the host then decodes through ``_decode_tiled_owned``, which calls the model's own tiler."""
    import comfy.utils

    fsm = vae.first_stage_model

    def decode_tiled(z, tile_x=8, tile_y=8, overlap=2, **_):
        return comfy.utils.tiled_scale(z, fsm.decode, tile_x=tile_x, tile_y=tile_y, overlap=overlap,
                                       upscale_amount=8, out_channels=3, output_device=z.device)

    def encode_tiled(x, tile_x=64, tile_y=64, overlap=16, **_):
        return comfy.utils.tiled_scale(x, fsm.encode, tile_x=tile_x, tile_y=tile_y, overlap=overlap,
                                       upscale_amount=1 / 8, out_channels=4, output_device=x.device)

    fsm.decode_tiled, fsm.encode_tiled = decode_tiled, encode_tiled
    vae.handles_tiling = True
    return vae


def test_vae_that_tiles_itself_runs_segmented(comfy, max_vram, pack):
    import comfy.sd
    if not hasattr(comfy.sd.VAE, "_decode_tiled_owned"):
        pytest.skip("this host has no VAEs that tile themselves (VAE._decode_tiled_owned)")
    vae = self_tiling(tm.load_tiny_vae(seed=0))
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    ref = vae.decode_tiled(latent, tile_x=8, tile_y=8, overlap=2)
    (_, _, patched), payload = max_vram(0.004, vae=vae)
    out = patched.decode_tiled(latent, tile_x=8, tile_y=8, overlap=2)
    assert torch.equal(out, ref)
    entry = next(e for e in payload["models"] if e["kind"] == "VAE")
    assert entry["stage"] == "measured", "the owned tiler must run inside the engine"
    # one forward of the engine is the whole tiled decode: each decoder unit entered once per tile
    calls = {u["name"]: u["calls"] for u in entry["plan"]["units"] if u["name"].startswith("decoder")}
    assert calls and min(calls.values()) > 1, calls
    assert vae.first_stage_model.decode_tiled.__name__ == "decode_tiled", "the pack's wrapper must be gone"


def test_text_generation_says_it_runs_outside_the_budget(comfy, max_vram, monkeypatch):
    import comfy.sd
    if not hasattr(comfy.sd.CLIP, "generate"):
        pytest.skip("this host has no text generation (CLIP.generate)")
    seen = []
    monkeypatch.setattr(comfy.sd.CLIP, "generate", lambda self, tokens, **kw: seen.append(tokens) or "generated")
    clip = tm.load_tiny_clip_l(seed=0)
    (_, patched, _), payload = max_vram(0.01, clip=clip)
    assert patched.generate({"l": []}) == "generated" and seen == [{"l": []}]
    assert payload["message_level"] == "notice" and "CLIP.generate" in payload["message"]
    assert "outside VRAMCut's budget" in payload["message"]


def test_decode_through_the_models_own_entry_point_says_so(comfy, max_vram):
    import comfy.sd
    if not hasattr(comfy.sd.VAE, "prepare_decode"):
        pytest.skip("this host has no VAE.prepare_decode")
    vae = tm.load_tiny_vae(seed=0)
    (_, _, patched), payload = max_vram(0.01, vae=vae)
    assert patched.prepare_decode((1, 4, 8, 8)) >= 1
    assert "VAE.prepare_decode" in payload["message"] and "outside VRAMCut's budget" in payload["message"]


def test_executor_allocations_are_kept_out_of_host_allocation_graphs(comfy, max_vram, pack, monkeypatch):
    """Newer hosts record a forward's allocations (``comfy.model_prefetch`` malloc graphs) and
    expect them to repeat; the executor's own allocations happen inside the host's
    ``pause_malloc_graph``. A stand-in pause (on hosts without one, a stand-in module) records
    whether each of the executor's buffers was allocated while paused."""
    paused = [False]
    allocated = []

    import contextlib

    @contextlib.contextmanager
    def pause_malloc_graph(sync=False):
        paused[0] = True
        try:
            yield
        finally:
            paused[0] = False

    mod = sys.modules.get("comfy.model_prefetch") or types.ModuleType("comfy.model_prefetch")
    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", mod)
    monkeypatch.setattr(mod, "pause_malloc_graph", pause_malloc_graph, raising=False)

    from torch.overrides import TorchFunctionMode

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.empty and kwargs.get("dtype") is torch.uint8:
                allocated.append(paused[0])
            return func(*args, **kwargs)

    model = tm.load_tiny_sd3(depth=4)
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, (1, 16, 8, 8), steps=2)
    from vramcut_core import find_units
    us = find_units(model.model.diffusion_model)
    (patched, _, _), _ = max_vram(us.weight_bytes * 0.5 / GIB + 0.002, model=model)
    with Watch():
        out = tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=2)
    assert torch.equal(out, ref)
    assert allocated and all(allocated), allocated
