"""What the user sees when the budget does not hold a call, through the Max VRAM node on the
host: a plain error naming what does not fit and the smallest budget while sampling; the host's
out-of-memory fallback only where it can help (a VAE call larger than one tile); tiny budgets;
the verify switch on the node; a real out-of-memory error inside a segment."""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from unit_checks import assert_peak_within_budget

GIB = 1 << 30


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


def entry(payload, kind):
    return next(e for e in payload["models"] if e["kind"] == kind)


def snapshot(module):
    return {n: (t, t.detach().clone()) for n, t in module.state_dict(keep_vars=True).items()}


def assert_same(module, snap):
    now = module.state_dict(keep_vars=True)
    for n, (t, vals) in snap.items():
        assert now[n] is t and torch.equal(now[n].detach(), vals), n


@pytest.mark.parametrize("gb,expect", [(1e-12, "less than one byte"), (1e-9, "1 B")])
def test_tiny_budgets_give_sensible_messages(comfy, max_vram, gb, expect):
    vae = tm.load_tiny_vae(seed=0)
    with pytest.raises(ValueError) as e:
        max_vram(gb, vae=vae)
    msg = str(e.value)
    assert expect in msg and "0.0 KiB" not in msg and "must be positive" not in msg
    if gb > 1e-10:  # weights alone, before any input: a lower bound, and said so
        assert "max_vram_gb must be at least" in msg and "smallest" not in msg


def test_sampling_budget_too_small_for_activations_is_a_plain_error(comfy, max_vram):
    model = tm.load_tiny_sd3(depth=2)
    pos, neg = tm.tiny_sd3_conditioning()
    latent = (2, 16, 32, 32)
    ref = tm.sample(model, pos, neg, latent, steps=1)
    (probe, _, _), payload = max_vram(1.0, model=model)
    tm.sample(probe, pos, neg, latent, steps=1)
    plan = entry(payload, "MODEL")["plan"]
    pinned = sum(u["weight_bytes"] for u in plan["units"] if u["keep_resident"])
    biggest = max(u["weight_bytes"] for u in plan["units"] if not u["keep_resident"])
    act = plan["activation_reserve_bytes"]
    assert act > 4 * biggest, "the activations must be what does not fit"
    budget = pinned + 2 * biggest + act // 2
    (patched, _, _), payload = max_vram(budget / GIB, model=model)
    with pytest.raises(Exception) as e:
        tm.sample(patched, pos, neg, latent, steps=1)
    assert not isinstance(e.value, torch.OutOfMemoryError), "no host fallback while sampling: not an OOM"
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert "activations" in msg and "smallest max_vram_gb" in msg and "input shape" in msg
    assert entry(payload, "MODEL") and payload["message_level"] == "error"
    assert torch.equal(tm.sample(model, pos, neg, latent, steps=1), ref), "the model is unchanged"


def _vae_activation_bytes(vae, latent):
    from vramcut_core import Engine, EngineConfig

    e = Engine(vae.first_stage_model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    e.run(vae.first_stage_model.decode, latent.to(vae.vae_dtype))
    return e.last_plan.activation_reserve_bytes


def test_small_latent_vae_decode_says_the_tiled_fallback_cannot_help(comfy, max_vram):
    from vramcut_core import find_units

    vae = tm.load_tiny_vae(seed=0)
    latent = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    act = _vae_activation_bytes(vae, latent)
    w = find_units(vae.first_stage_model).weight_bytes
    (_, _, pv), payload = max_vram((w + act // 3) / GIB, vae=vae)
    with pytest.raises(ValueError) as e:
        pv.decode(latent)
    assert not isinstance(e.value, torch.OutOfMemoryError)
    msg = str(e.value)
    assert "tiled fallback" in msg and "smallest max_vram_gb" in msg and "activations" in msg
    assert payload["message_level"] == "error" and "tiled fallback" in payload["message"]


def test_vae_encoder_down_block_is_cut_through_its_block_list(comfy):
    from vramcut_core import find_units, split_unit

    vae = tm.load_tiny_vae(seed=0)
    us = find_units(vae.first_stage_model)
    unit = next(u for u in us.units if u.name == "encoder.down.3")
    parts = split_unit(unit)
    assert parts is not None and len([p for p in parts if not p.keep_resident]) >= 2
    assert sum(p.weight_bytes for p in parts) == unit.weight_bytes


def test_verify_switch_reports_max_abs_diff_on_the_node(comfy, max_vram, monkeypatch):
    from vramcut_core import find_units

    monkeypatch.setenv("VRAMCUT_VERIFY", "1")
    vae = tm.load_tiny_vae(seed=0)
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    ref = vae.decode(latent)
    w = find_units(vae.first_stage_model).weight_bytes
    (_, _, pv), payload = max_vram((w * 0.6 + (32 << 20)) / GIB, vae=vae)
    assert torch.equal(pv.decode(latent), ref)
    pv.decode(latent)  # the same shape: verified once
    v = entry(payload, "VAE")["verify"]
    assert len(v) == 1 and v[0]["max_abs_diff"] == 0.0 and v[0]["equal"] is True
    assert_peak_within_budget(entry(payload, "VAE")["plan"])


def test_out_of_memory_inside_a_segment_while_sampling(comfy, max_vram):
    model = tm.load_tiny_sd3(depth=3)
    pos, neg = tm.tiny_sd3_conditioning()
    latent = (1, 16, 8, 8)
    ref = tm.sample(model, pos, neg, latent, steps=2)
    snap = snapshot(model.model.diffusion_model)
    from vramcut_core import find_units
    us = find_units(model.model.diffusion_model)
    w = us.weight_bytes
    (patched, _, _), payload = max_vram((w * 0.5 + (8 << 20)) / GIB, model=model)
    block = model.model.diffusion_model.joint_blocks[1]
    orig = block.forward

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")

    block.forward = oom
    try:
        with pytest.raises(torch.OutOfMemoryError) as e:
            tm.sample(patched, pos, neg, latent, steps=2)
    finally:
        del block.forward
    assert block.forward == orig
    msg = str(e.value)
    assert "joint_blocks.1" in msg and "segment" in msg and "budget" in msg and "1.50 GiB" in msg
    engines = list(patched.attachments["vramcut"]._engines.values())
    assert all(e.executor.device_bytes == 0 for e in engines), "everything released"
    assert_same(model.model.diffusion_model, snap)
    assert torch.equal(tm.sample(patched, pos, neg, latent, steps=2), ref), "the next prompt works"
    assert torch.equal(tm.sample(model, pos, neg, latent, steps=2), ref)
