"""``plan`` on all-in-one checkpoints: the diffusion model, the text encoders and the VAE are each
planned on their own under the budget (as the node plans MODEL, CLIP and VAE), and each plan is
the plan of that component's keys alone. Headers only, with real SD1.5/SDXL key names and shapes."""
import json

import pytest

import checkpoint_headers as ch
from test_cli import flux_like_entries, write_header_only
from vramcut_core.cli.commands import main
from vramcut_core.planning.plan import make_plan
from vramcut_core.planning.report import plan_to_text
from vramcut_core.formats.safetensors_plan import plan_units_from_header, read_header, split_components

GIB = 1 << 30
CHECKPOINTS = {"sd15": ch.sd15_components, "sdxl": ch.sdxl_components}


def _plan_json(capsys, path, gib, *extra):
    rc = main(["plan", str(path), "--max-vram", str(gib), "--json", *extra])
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out)


def _all_in_one(tmp_path, name):
    parts = CHECKPOINTS[name]()
    path = tmp_path / f"{name}_all_in_one.safetensors"
    total = write_header_only(path, {k: v for p in parts.values() for k, v in p.items()})
    return path, parts, total


@pytest.mark.parametrize("name,gib", [("sd15", 0.5), ("sd15", 1), ("sdxl", 1), ("sdxl", 3)])
def test_each_component_is_planned_as_its_own_header(tmp_path, capsys, name, gib):
    path, parts, total = _all_in_one(tmp_path, name)
    out = _plan_json(capsys, path, gib)
    assert out["all_in_one"] is True and out["budget_bytes"] == int(gib * GIB)
    assert [c["component"] for c in out["components"]] == ["MODEL", "CLIP", "VAE"]
    for comp in out["components"]:
        own = tmp_path / f"{name}_{comp['component']}.safetensors"
        write_header_only(own, parts[comp["component"]])
        alone = _plan_json(capsys, own, gib)
        assert comp["plan"] == alone, comp["component"]
        names = [u["name"] for u in comp["plan"]["units"]]
        # every unit is the component's own (keys outside its block lists may group as a bare
        # prelude/final, the component being named in the title)
        assert all(n.startswith(tuple(comp["prefixes"])) or n in ("prelude", "final") for n in names), names
        assert comp["plan"]["peak_bytes"] <= comp["plan"]["budget_bytes"] == int(gib * GIB)
        assert comp["weight_bytes"] == sum(u["weight_bytes"] for u in comp["plan"]["units"])
    planned = sum(c["weight_bytes"] for c in out["components"])
    assert planned + out["not_planned"]["bytes"] == total
    assert out["not_planned"]["keys"] == len(parts["rest"])


def test_sd15_text_encoder_is_no_longer_a_segment_between_unet_and_vae_blocks(tmp_path, capsys):
    path, _, _ = _all_in_one(tmp_path, "sd15")
    out = _plan_json(capsys, path, 1)
    model, clip, vae = out["components"]
    assert model["prefixes"] == ["model.diffusion_model."]
    assert clip["prefixes"] == ["cond_stage_model."] and vae["prefixes"] == ["first_stage_model."]
    # the whole CLIP-L (246 MB fp16) fits 1 GiB: one resident segment, nothing streamed
    assert clip["plan"]["streamed_bytes_per_forward"] == 0 and len(clip["plan"]["segments"]) == 1
    layers = [u for u in clip["plan"]["units"] if ".encoder.layers." in u["name"]]
    assert len(layers) == 12
    # the UNet alone is 1.6 GiB: it streams at 1 GiB
    assert model["plan"]["streamed_bytes_per_forward"] > 0
    assert {u["name"] for u in model["plan"]["units"]} >= {
        "model.diffusion_model.input_blocks.0", "model.diffusion_model.output_blocks.11"}


def test_sdxl_both_text_encoders_are_one_clip_plan(tmp_path, capsys):
    path, _, _ = _all_in_one(tmp_path, "sdxl")
    out = _plan_json(capsys, path, 3)
    clip = out["components"][1]
    assert clip["component"] == "CLIP" and clip["prefixes"] == ["conditioner.embedders."]
    names = [u["name"] for u in clip["plan"]["units"]]
    assert sum(".text_model.encoder.layers." in n for n in names) == 12
    assert sum(".transformer.resblocks." in n for n in names) == 32


def test_text_output_names_each_component_and_what_is_not_planned(tmp_path, capsys):
    path, parts, _ = _all_in_one(tmp_path, "sd15")
    assert main(["plan", str(path), "--max-vram", "1"]) == 0
    text = capsys.readouterr().out
    for name, head in (("MODEL", "MODEL (diffusion model, model.diffusion_model.*)"),
                       ("CLIP", "CLIP (text encoders, cond_stage_model.*)"), ("VAE", "VAE (VAE, first_stage_model.*)")):
        assert head in text
        own = tmp_path / f"own_{name}.safetensors"
        write_header_only(own, parts[name])
        table = plan_to_text(make_plan(plan_units_from_header(read_header(str(own))), GIB))
        assert f"{head}: " in text and table in text, name
    assert "not planned: 3 keys" in text and "alphas_cumprod" in text


def test_a_component_too_large_for_the_budget_is_named(tmp_path, capsys):
    path, _, _ = _all_in_one(tmp_path, "sdxl")
    # 0.1 GiB: SDXL's UNet blocks with ten transformer blocks each are larger (the header planner
    # does not cut finer)
    assert main(["plan", str(path), "--max-vram", "0.1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "too small" in err
    assert err.startswith("vramcut: error: MODEL (diffusion model, model.diffusion_model.*): ")


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_component_files_are_planned_as_before(tmp_path, capsys, prefix):
    path = tmp_path / "unet.safetensors"
    entries = flux_like_entries(prefix=prefix, d=256, n_double=4, n_single=6)
    write_header_only(path, entries)
    comps, rest = split_components({k: {} for k in entries})
    assert len(comps) == 1 and comps[0].name == "" and rest == {}
    out = _plan_json(capsys, path, 0.01)
    assert "all_in_one" not in out and "units" in out and "segments" in out


def test_text_encoder_or_vae_file_alone_is_one_component():
    for entries in (ch.clip_l("cond_stage_model."), ch.kl_vae("first_stage_model."),
                    ch.clip_l("conditioner.embedders.0.") | ch.open_clip_g("conditioner.embedders.1.")):
        comps, rest = split_components(entries)
        assert [c.name for c in comps] == [""] and rest == {}


def test_all_in_one_gguf_is_planned_per_component(tmp_path, capsys):
    import numpy as np

    from test_quant_formats import write_gguf

    sd = {}
    for i in range(4):
        sd[f"model.diffusion_model.input_blocks.{i}.0.weight"] = np.ones((64, 64), np.float32)
        sd[f"cond_stage_model.transformer.text_model.encoder.layers.{i}.mlp.fc1.weight"] = np.ones((64, 64), np.float32)
        sd[f"first_stage_model.decoder.up.{i}.block.0.conv1.weight"] = np.ones((64, 64), np.float32)
    path = tmp_path / "aio.gguf"
    write_gguf(path, sd)
    out = _plan_json(capsys, path, 0.001)
    assert [c["component"] for c in out["components"]] == ["MODEL", "CLIP", "VAE"]
    for c in out["components"]:
        assert len(c["plan"]["units"]) == 4
        assert all(u["name"].startswith(c["prefixes"][0]) or u["name"] in ("prelude", "final")
                   for u in c["plan"]["units"])
        assert c["weight_bytes"] == 4 * 64 * 64 * 4   # stored F32
