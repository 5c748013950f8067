"""The RAM budget through the real host (``max_ram_gb`` on the Max VRAM node): a model loaded by
a host path runs with the units that do not fit the budget read from disk each call, its output
the unpatched model's. Loader paths: weights mapped from their checkpoint (as the host keeps a
memory-mapped model: they are read from that file), and the plain ``load_torch_file`` then
``load_state_dict`` path (weights in anonymous memory: written once to the model's cache file, the
RAM copy released). ComfyUI-GGUF's reader (a .gguf mapped by its numpy memmap) is read from the .gguf itself. The
engine side is ``tests/core/test_tiers.py``."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

import tiny_models as tm
from toys import map_from_file

LATENT = (1, 16, 8, 8)


def _engine(pack, patched):
    (engine,) = pack.nodes.patcher.state_of(patched)._engines.values()
    return engine


def _here_first():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _loaded(path, tmp_path):
    if path == "gguf":  # ComfyUI-GGUF's reader: its tensors are views of the file's numpy memmap
        _here_first()
        try:
            from test_quantized import load_gguf_unet
        finally:
            sys.path.pop(0)
        return load_gguf_unet(tmp_path, "tiny_sd3_ram.gguf", tm.tiny_sd3_state_dict(depth=2), "Q8_0")
    if path == "mapped":
        model = tm.load_tiny_sd3(depth=2)
        map_from_file(model.model.diffusion_model, str(tmp_path))
        return model
    import comfy.utils
    from safetensors.torch import save_file

    f = str(tmp_path / "tiny_sd3.safetensors")
    save_file({k: v.contiguous() for k, v in tm.tiny_sd3_state_dict(depth=2).items()}, f)
    return tm.load_tiny_sd3(state_dict=comfy.utils.load_torch_file(f))


@pytest.mark.parametrize("path", ["mapped", "load_torch_file", "gguf"])
def test_max_ram_reads_what_does_not_fit_from_disk(comfy, pack, max_vram, tmp_path, monkeypatch, path):
    monkeypatch.setenv("VRAMCUT_CACHE_DIR", str(tmp_path / "cache"))
    hm = pack.vramcut_core.runtime.host_memory
    model = _loaded(path, tmp_path)
    pos, neg = tm.tiny_sd3_conditioning()
    with torch.inference_mode():
        ref = tm.sample(model, pos, neg, LATENT, steps=2)
        (patched, _, _), payload = max_vram(0.002, model=model, max_ram_gb=0.001)
        out = tm.sample(patched, pos, neg, LATENT, steps=2)
    engine = _engine(pack, patched)
    plan = engine.last_plan
    assert engine.config.ram_budget_bytes == int(0.001 * 2**30)
    assert torch.equal(out, ref)
    t = plan.tiers
    assert t.disk_units and t.host_bytes <= t.ram_budget_bytes
    st = engine.last_stats  # (a call that loaded a group on entry reads it once more: a host's
    # cond and uncond of another shape switch plans; the exact count is the engine tests')
    assert st.disk_bytes_read >= t.disk_bytes_per_call > 0
    assert st.sync_loads or st.disk_bytes_read == t.disk_bytes_per_call
    files = engine.executor.masters.tiers.files()
    if path == "mapped":
        assert files == [str(tmp_path / "model.safetensors")], "read from the checkpoint itself"
    elif path == "gguf":  # the quantized blocks from the .gguf; what the reader converted on load, cached
        assert str(tmp_path / "unet_gguf" / "tiny_sd3_ram.gguf") in files and len(files) <= 2, files
    else:
        assert len(files) == 1 and files[0].startswith(str(tmp_path / "cache"))
        assert os.path.getsize(files[0]) == engine.executor.masters.tiers.cache_bytes
    for n in t.disk_units:  # no RAM copy of their own left
        assert all(hm.file_backed([ut.tensor for ut in engine.planner.unit(n).tensors]))
    # the node's entry after the run: the tiers, and what the load cost (the node's load line)
    (entry,) = [m for m in payload["models"] if m["kind"] == "MODEL"]
    assert entry["stage"] == "measured" and entry["tiers"]["disk_bytes_per_call"] == t.disk_bytes_per_call
    load = entry["tiers"]["load"]
    assert load == engine.executor.masters.tiers.load_json()
    if path == "load_torch_file":  # the host's loader held them in anonymous memory: cached, released
        assert load["cached_bytes"] > 0 and load["mapped_bytes"] == 0 and load["released_bytes"] is not None
    else:
        assert load["mapped_bytes"] > 0


def test_max_ram_on_the_simulated_accelerator_reads_through_the_bounce_buffer(sim, pack, tmp_path, monkeypatch):
    """Through the adapter on the CUDA branch: a host model (``comfy.ops`` layers) mapped from its
    checkpoint, patched with ``max_ram_gb``, runs a sampling run of three steps: its disk units
    pass through the page-locked bounce buffer, its output is the plain forward's."""
    import comfy.model_patcher
    from compiler_host import BaseModelStandIn
    _here_first()
    try:
        from test_teardown_pinned import Stack, _run  # the host model and sampling run of those tests
    finally:
        sys.path.pop(0)

    monkeypatch.setenv("VRAMCUT_CACHE_DIR", str(tmp_path / "cache"))
    hm = pack.vramcut_core.runtime.host_memory
    monkeypatch.setattr(hm, "BOUNCE_PIECE", 4096)
    monkeypatch.setattr(hm, "_BOUNCE", None)
    for k, v in (("room", None), ("bytes", 0), ("cap", -1)):  # the pack's ledger, fresh, no cap of its own
        monkeypatch.setattr(hm.PAGE_LOCKED, k, v)
    st = pack.nodes.state
    # (hosts differ in what they page-lock themselves and the room they leave: here, all of it)
    monkeypatch.setattr(st, "may_page_lock", lambda: True)
    hooks = st.host_hooks
    monkeypatch.setattr(st, "host_hooks", lambda dev: dataclasses.replace(hooks(dev), page_lock_room=None))
    with sim.host_memory():
        torch.manual_seed(0)
        model = Stack()
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
        map_from_file(model, str(tmp_path))
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(2, 8, 16, generator=g), torch.rand(2, generator=g)
        with torch.no_grad():
            ref = model(x, t)
    base = BaseModelStandIn(model)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cuda"),
                                               offload_device=torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    settings = st.Settings(max_vram_gb=weights * 0.6 / 2**30, max_ram_gb=12e3 / 2**30)
    clone = pack.nodes.patching.patch_model(patcher, settings, st.NodeReport(None, settings))
    outs = _run(base, clone, (x, t))
    engine = st.state_of(clone)._engines[model]
    tiers = engine.last_plan.tiers
    assert all(torch.equal(o, ref) for o in outs)
    assert tiers.disk_units and tiers.bounce_bytes == 2 * 4096
    assert engine.last_stats.disk_bytes_read == tiers.disk_bytes_per_call > 0
    assert engine.executor.masters.tiers.files() == [str(tmp_path / "model.safetensors")]
    assert all(b.data_ptr() in sim.registered for b in hm._BOUNCE().bufs)
    clone.detach(unpatch_all=True)
