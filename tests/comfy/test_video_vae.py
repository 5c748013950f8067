"""The Wan 2.1 video VAE through VRAMCut: its decoder runs once per latent frame.

The VAE is built the way ComfyUI builds it from a file: ``comfy.sd.VAE(sd=...)`` with the real
Wan 2.1 key layout (``decoder.middle.0.residual.0.gamma`` and no
``decoder.upsamples.0.upsamples.0.residual.2.weight``: Wan 2.1, not 2.2), so ComfyUI picks
``comfy.ldm.wan.vae.WanVAE(dim=96, z_dim=16, ...)`` itself. The weights are seeded random, full
size (~127M parameters, float32 on CPU).

``WanVAE.decode`` applies ``conv2`` once, then calls ``decoder`` once per latent frame (ComfyUI
0.3.x) or once per chunk of frames (newer hosts decode the frames after the first in chunks); a
feature cache carries the causal state between passes. The tests count the host's own decoder
passes in the unpatched decode and expect the plan to show the same count. VRAMCut's ``wan_vae`` registry entry cuts it into

* the encoder's units (``encoder.prelude``, ``encoder.downsamples.*``, ``encoder.middle``,
  ``encoder.head``) and the root's ``conv1`` / ``conv2``: a decode enters only ``conv2``, once;
* ``decoder.prelude`` (``decoder.conv1``), ``decoder.middle``, ``decoder.upsamples.0`` ... ``14``
  and ``decoder.head``: each entered as often as the host's decode runs it (``calls``, counted in
  the unpatched decode: 3 each for a 3-frame latent on ComfyUI 0.3.x).

A budget that holds the decoder's weights plus the activations keeps those looped units resident
(nothing of the decoder is re-sent per frame); a tighter one streams them on every pass and the
plan says so. Budgets are picked from a measured plan at a generous budget.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from pack_nodes import run_node
from unit_checks import assert_peak_within_budget

GIB = 1 << 30
MIB = 1 << 20
LATENT = (1, 16, 3, 8, 8)  # 3 latent frames -> 9 frames of 64x64
# One thread: faster on a loaded 2-core host (see tiny_models.torch_threads); every decode that is
# compared runs with the same count, since conv kernels may sum in another order with another one.
THREADS = 1


def wan21_vae_state_dict(seed=0):
    """Seeded weights with the key names and shapes of a Wan 2.1 VAE file (wan_2.1_vae.safetensors)."""
    import comfy.ldm.wan.vae

    m = comfy.ldm.wan.vae.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                 temperal_downsample=[False, True, True], dropout=0.0)
    return tm._module_state_dict(m, seed)


def decoder_unit_roots(decoder):
    """The module whose call starts each decoder unit in the host's decode. ``middle`` and
    ``head`` are sequences the decoder iterates (their own forward never runs): their first
    layer marks the unit."""
    roots = {"decoder.prelude": decoder.conv1, "decoder.middle": decoder.middle[0]}
    roots.update({f"decoder.upsamples.{i}": m for i, m in enumerate(decoder.upsamples)})
    roots["decoder.head"] = decoder.head[0]
    return roots


def vae_entry(payload):
    return next(e for e in payload["models"] if e["kind"] == "VAE")


def engine_of(pack, patched_vae):
    (engine,) = pack.nodes.patcher.state_of(patched_vae.patcher)._engines.values()
    return engine


def looped(plan):
    return [u for u in plan["units"] if u["calls"] > 1]


def resident_names(plan):
    return {n for s in plan["segments"] if s["resident"] for n in s["units"]}


def streamed_looped_bytes(plan):
    """Bytes of the looped units that stream, times the passes that copy them."""
    res = resident_names(plan)
    return sum(u["weight_bytes"] * u["calls"] for u in looped(plan) if u["entered"] and u["name"] not in res)


@pytest.fixture(scope="module")
def runs(comfy, pack):
    """The unpatched decode, then patched decodes at three budgets: generous (everything fits),
    roomy (the looped decoder units + activations + half the rest), tight (below the looped
    units + activations). The roomy and tight VAEs decode twice: the measured forward, then one
    under the measured plan (the generous one only measures: its plan gives the numbers)."""
    import comfy.sd

    def max_vram(gb, vae):
        out, ui = run_node(pack, "VRAMCutMaxVRAM", "1", max_vram_gb=gb, budget_mode="fixed", reserve_gb=1.0,
                           prefetch=True, residency=True, vae=vae)
        return out[2], ui["vramcut"][0]

    out = {}
    with tm.torch_threads(THREADS), torch.inference_mode():
        vae = comfy.sd.VAE(sd=wan21_vae_state_dict())
        assert type(vae.first_stage_model).__module__ == "comfy.ldm.wan.vae", "ComfyUI must detect the Wan 2.1 VAE"
        assert vae.latent_channels == 16 and vae.latent_dim == 3
        latent = torch.randn(LATENT, generator=torch.Generator().manual_seed(0))
        counts = {name: 0 for name in decoder_unit_roots(vae.first_stage_model.decoder)}
        hooks = [m.register_forward_pre_hook(lambda *_, n=name: counts.__setitem__(n, counts[n] + 1))
                 for name, m in decoder_unit_roots(vae.first_stage_model.decoder).items()]
        try:
            ref = vae.decode(latent)
        finally:
            for h in hooks:
                h.remove()
        assert 1 < counts["decoder.prelude"] <= LATENT[2], "the decoder runs more than once, at most once per frame"
        out["host_calls"] = counts
        assert ref.shape == (1, 9, 8 * LATENT[3], 8 * LATENT[4], 3) and torch.isfinite(ref).all()
        out["vae"], out["latent"], out["ref"] = vae, latent, ref

        def run(name, gb, twice=True):
            pv, payload = max_vram(gb, vae)
            assert type(pv).__name__ == "VRAMCutVAE"
            first = pv.decode(latent)
            second = pv.decode(latent) if twice else None
            eng = engine_of(pack, pv)
            out[name] = dict(gb=gb, first=first, second=second, payload=payload, family=eng.unitset.family,
                             plan=vae_entry(payload)["plan"], stats=eng.last_stats)

        run("generous", 2.0, twice=False)
        p = out["generous"]["plan"]
        loop_w = sum(u["weight_bytes"] for u in looped(p))
        rest_w = sum(u["weight_bytes"] for u in p["units"]) - loop_w
        act = p["activation_reserve_bytes"]
        out["numbers"] = dict(looped_weight_bytes=loop_w, other_weight_bytes=rest_w, activation_bytes=act)
        run("roomy", (loop_w + act + rest_w // 2) / GIB)
        run("tight", 0.85 * (loop_w + act) / GIB)
    return out


def test_decoder_units_are_entered_as_often_as_the_host_runs_them(runs):
    """Every decoder unit is entered as often as the host's own decode runs it (counted in the
    unpatched decode: once per latent frame on ComfyUI 0.3.x; newer hosts decode frames in
    chunks, and the upsampling stages after a temporal upsample once per 2-frame chunk); the
    unit holding conv2 (and the encoder) once per decode."""
    p = runs["generous"]["plan"]
    assert p["measured"]
    by = {u["name"]: u for u in p["units"]}
    dec = [n for n in by if n.startswith("decoder.")]
    assert runs["generous"]["family"] == "wan_vae"
    assert "decoder.prelude" in dec and "decoder.middle" in dec and "decoder.head" in dec and len(dec) == 18
    assert {n: by[n]["calls"] for n in dec} == runs["host_calls"]
    assert {u["name"] for u in looped(p)} == set(dec)
    # conv2 runs once per decode; the encoder's units never run in a decode
    assert by["conv2"]["calls"] == 1 and by["conv2"]["entered"]
    assert not [n for n in by if n.startswith("encoder") and by[n]["entered"]]
    n = runs["numbers"]
    assert n["looped_weight_bytes"] > 200 * MIB and n["activation_bytes"] > 0


@pytest.mark.parametrize("name", ["generous", "roomy", "tight"])
def test_decode_matches_unpatched(runs, name):
    r = runs[name]
    assert torch.equal(r["first"], runs["ref"]), "measured decode"
    if r["second"] is not None:
        assert torch.equal(r["second"], runs["ref"]), "planned decode"
    assert r["plan"]["peak_bytes"] <= r["plan"]["budget_bytes"]
    assert_peak_within_budget(r["plan"])
    assert vae_entry(r["payload"])["stage"] == "measured"


def test_original_vae_is_unchanged(runs):
    vae = runs["vae"]
    assert type(vae).__name__ == "VAE"
    assert "decode" not in vars(vae.first_stage_model)
    with tm.torch_threads(THREADS), torch.inference_mode():
        assert torch.equal(vae.decode(runs["latent"]), runs["ref"])


def test_generous_budget_keeps_everything_resident(runs):
    p = runs["generous"]["plan"]
    assert p["streamed_bytes_per_forward"] == 0 and p["slots"] == 0
    assert all(s["resident"] for s in p["segments"])


def test_roomy_budget_keeps_the_per_frame_units_resident(runs):
    """Budget: the looped units' weights + activations + half of the other weights. The looped
    units are resident, so no decoder weight is re-sent per frame; only the units a decode
    enters once (``conv2``) may stream."""
    r, n = runs["roomy"], runs["numbers"]
    p = r["plan"]
    assert p["budget_bytes"] < n["looped_weight_bytes"] + n["other_weight_bytes"] + n["activation_bytes"], \
        "the roomy budget must not hold everything"
    res = resident_names(p)
    assert all(u["name"] in res for u in looped(p)), [u["name"] for u in looped(p) if u["name"] not in res]
    assert streamed_looped_bytes(p) == 0
    assert not any("every pass" in w for w in p["warnings"])
    # what the planned decode really copied: no decoder weights (a few KiB of conv2 & co.)
    assert r["stats"].bytes_streamed < MIB, r["stats"].bytes_streamed


def test_roomy_plan_counts_only_what_a_decode_runs(runs):
    p = runs["roomy"]["plan"]
    assert not [u["name"] for u in p["units"] if u["name"].startswith("encoder") and u["entered"]]
    assert p["streamed_bytes_per_forward"] < MIB


def test_tight_budget_streams_the_per_frame_units_and_warns(runs):
    """Below the looped units' weights + activations: they stream, each copied once per frame,
    and the plan warns about it."""
    r = runs["tight"]
    p = r["plan"]
    res = resident_names(p)
    streamed = [u for u in looped(p) if u["name"] not in res]
    assert streamed, "the tight budget must make looped units stream"
    assert any("copied on every pass" in w for w in p["warnings"]), p["warnings"]
    per_pass = streamed_looped_bytes(p)
    assert per_pass == sum(u["weight_bytes"] * runs["host_calls"][u["name"]] for u in streamed)
    assert p["streamed_bytes_per_forward"] >= per_pass
    # the planned decode really copied them once per frame
    assert r["stats"].bytes_streamed >= per_pass


def test_tight_decode_does_not_copy_the_encoder(runs):
    r = runs["tight"]
    assert r["stats"].bytes_streamed <= streamed_looped_bytes(r["plan"]) + MIB, r["stats"].bytes_streamed
