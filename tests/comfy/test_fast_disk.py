"""Fast-disk loading through the real host: a model whose weights are mapped from its checkpoint
file (as ComfyUI keeps a model it streams from a fast disk) and that the host marks ``fast_disk``
(ComfyUI 0.38: the patcher's own attribute, passed on by ``clone()``; 0.33: ``--fast-disk``) is
run by the Max VRAM node with its mapped tensors as the host masters: no copy of the model in
RAM, the output the unpatched model's. The engine side (the page-locked window on the CUDA
branch) is ``tests/core/test_file_backed.py``."""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from newest_host import newest_patcher_class as _newest_patcher_class
from toys import map_from_file

LATENT = (1, 16, 8, 8)


def _file_backed_sd3(tmp_path):
    """A tiny SD3 loaded by the host, its weights then assigned from a safetensors file of
    themselves: every tensor mapped from the file, as the host keeps a file-backed model."""
    model = tm.load_tiny_sd3(depth=2)
    map_from_file(model.model.diffusion_model, str(tmp_path))
    return model


def _where(model):
    return {k: t.data_ptr() for k, t in model.model.diffusion_model.state_dict().items()}


def _engine(pack, patched):
    (engine,) = pack.nodes.patcher.state_of(patched)._engines.values()
    return engine


@pytest.fixture
def no_cli_switch(comfy, monkeypatch):
    from comfy.cli_args import args
    monkeypatch.setattr(args, "fast_disk", False, raising=False)
    monkeypatch.setattr(args, "disable_fast_disk", False, raising=False)
    return args


@pytest.mark.parametrize("source", ["patcher", "cli"])
def test_fast_disk_model_keeps_its_mapped_weights_as_masters(comfy, pack, max_vram, tmp_path, no_cli_switch,
                                                              monkeypatch, source):
    hm = pack.vramcut_core.runtime.host_memory
    model = _file_backed_sd3(tmp_path)
    if source == "patcher":  # ComfyUI 0.38: decided per model by the loader
        model.__class__ = _newest_patcher_class()
        model.fast_disk = True
    else:                    # 0.33: the process-wide switch
        monkeypatch.setattr(no_cli_switch, "fast_disk", True)
    pos, neg = tm.tiny_sd3_conditioning()
    with torch.inference_mode():
        ref = tm.sample(model, pos, neg, LATENT, steps=2)
        where = _where(model)
        (patched, _, _), payload = max_vram(0.002, model=model)
        out = tm.sample(patched, pos, neg, LATENT, steps=2)
        again = tm.sample(patched.clone(), pos, neg, LATENT, steps=2)
    engine = _engine(pack, patched)
    assert engine.config.keep_file_backed is True
    assert engine.last_plan.streamed_order, "the model streams"
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert _where(model) == where, "the mapped tensors stay the model's weights"
    assert all(hm.file_backed(list(model.model.diffusion_model.state_dict().values())))


@pytest.mark.parametrize("decided,switch,expected", [
    (False, None, False), (None, None, False), (None, "fast_disk", True), (None, "disable_fast_disk", False),
    (True, "disable_fast_disk", True),  # the patcher's answer already applied the switches (0.38)
])
def test_host_fast_disk_follows_the_patcher_then_the_switch(comfy, pack, no_cli_switch, monkeypatch,
                                                            decided, switch, expected):
    model = tm.load_tiny_sd3(depth=2)
    if decided is not None:
        model.__class__ = _newest_patcher_class()
        model.fast_disk = decided
    if switch == "fast_disk":
        monkeypatch.setattr(no_cli_switch, "fast_disk", True)
    elif switch == "disable_fast_disk":
        monkeypatch.setattr(no_cli_switch, "fast_disk", True)
        monkeypatch.setattr(no_cli_switch, "disable_fast_disk", True)
    assert pack.nodes.gpu.host_fast_disk(model) is expected


def test_without_fast_disk_the_engine_option_is_off(comfy, pack, max_vram, no_cli_switch):
    model = tm.load_tiny_sd3(depth=2)
    pos, neg = tm.tiny_sd3_conditioning()
    with torch.inference_mode():
        ref = tm.sample(model, pos, neg, LATENT, steps=2)
        (patched, _, _), _ = max_vram(0.002, model=model)
        out = tm.sample(patched, pos, neg, LATENT, steps=2)
    assert _engine(pack, patched).config.keep_file_backed is False
    assert torch.equal(out, ref)
