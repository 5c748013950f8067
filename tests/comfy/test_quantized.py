"""Quantized checkpoints stream as stored: tiny SD3 models written in each quantized format the
host reads, loaded through the host's own loaders (UNETLoader for comfy-kitchen formats, the
real ComfyUI-GGUF pack's UnetLoaderGGUF for .gguf), sampled through the KSampler node with and
without Max VRAM (LoRA before and after the node): the latents match bit for bit, the weights
on the device are the stored bytes the plan promised, and the measured peak stays in budget."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest
import torch

import tiny_models as tm
from host_cases import forward_peaks  # noqa: F401 (a fixture)
GIB = 1 << 30


def snapshot(module):
    return {n: (t, t.device, t.detach().clone()) for n, t in
            list(module.named_parameters()) + list(module.named_buffers())}


def assert_same(module, snap):
    now = dict(list(module.named_parameters()) + list(module.named_buffers()))
    assert set(now) == set(snap)
    for n, (t, dev, vals) in snap.items():
        # values and devices (ComfyUI's quantized ops re-wrap Parameters whenever a module is
        # moved, so the objects may be new ones)
        assert type(now[n]) is type(t) and now[n].device == dev, n
        a, b = now[n].detach(), vals
        if type(a) is not torch.Tensor or a.dtype.itemsize == 1:  # compare stored bytes
            a, b = _raw(a), _raw(b)
        assert torch.equal(a, b), n


def _raw(t):
    import vramcut_core.model.quant as q
    ps = q.parts(t)
    return torch.cat([p.reshape(-1).view(torch.uint8) for p in ps]) if ps else t.reshape(-1).view(torch.uint8)

LATENT = (1, 16, 8, 8)
DEPTH = 4


# --------------------------------------------------------------------------------------------
# comfy-kitchen formats (ComfyUI's UNETLoader)
# --------------------------------------------------------------------------------------------

def _quantizable(k: str, v: torch.Tensor) -> bool:
    return k.startswith("joint_blocks.") and k.endswith(".weight") and v.ndim == 2 and min(v.shape) >= 32


def fp8_scaled_sd(sd):
    """The layout of the ``*_fp8_scaled`` checkpoints: a ``scaled_fp8`` marker, fp8 weights and a
    per-layer ``scale_weight`` (ComfyUI converts it to ``comfy_quant`` metadata on load)."""
    out = {}
    for k, v in sd.items():
        if _quantizable(k, v):
            scale = v.abs().amax().float() / 448.0
            out[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            out[k[:-len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[k] = v
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def _comfy_quant(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode("utf-8")), dtype=torch.uint8)


def int8_sd(sd):
    """``int8_tensorwise`` with ``comfy_quant`` metadata per layer (int8 weight, fp32 scale)."""
    out = {}
    for k, v in sd.items():
        if _quantizable(k, v):
            scale = v.abs().amax().float() / 127.0
            base = k[:-len(".weight")]
            out[k] = torch.round(v.float() / scale).clamp(-127, 127).to(torch.int8)
            out[base + ".weight_scale"] = scale.reshape(())
            out[base + ".comfy_quant"] = _comfy_quant("int8_tensorwise")
        else:
            out[k] = v
    return out


def kitchen_layout_sd(sd, fmt):
    """A comfy-kitchen block format (mxfp8, nvfp4) quantized by the host's own layout class."""
    from comfy.quant_ops import QUANT_ALGOS, get_layout_class
    layout = get_layout_class(QUANT_ALGOS[fmt]["comfy_tensor_layout"])
    out = {}
    for k, v in sd.items():
        if _quantizable(k, v):
            base = k[:-len(".weight")]
            qdata, params = layout.quantize(v.float())
            out[k] = qdata
            if fmt == "nvfp4":
                out[base + ".weight_scale"] = params.block_scale
                out[base + ".weight_scale_2"] = params.scale
            else:
                out[base + ".weight_scale"] = params.scale
            out[base + ".comfy_quant"] = _comfy_quant(fmt)
        else:
            out[k] = v
    return out


def _kitchen_missing(fmt: str) -> str | None:
    """Why the host cannot run ``fmt`` here, or None (detected by presence, then by trying)."""
    try:
        import comfy.quant_ops as q
    except ImportError:
        return "this ComfyUI has no comfy.quant_ops (comfy-kitchen quantized tensors)"
    if not getattr(q, "_CK_AVAILABLE", False):
        return "comfy_kitchen is not installed in this ComfyUI environment"
    if fmt not in getattr(q, "QUANT_ALGOS", {}):
        return f"this ComfyUI's QUANT_ALGOS has no {fmt!r}"
    return None


def save_unet(tmp_path, name, sd):
    from safetensors.torch import save_file
    import folder_paths
    d = tmp_path / "diffusion_models"
    d.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / name))
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    return name


def load_unet(name):
    from nodes import UNETLoader
    return UNETLoader().load_unet(name, "default")[0]


# --------------------------------------------------------------------------------------------
# GGUF (the real ComfyUI-GGUF pack)
# --------------------------------------------------------------------------------------------

GGUF_DIR = "ComfyUI-GGUF"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def gguf_pack():
    """The ComfyUI-GGUF package from the host's custom_nodes, imported as ComfyUI imports it.
    Without the pack the GGUF tests skip and say why, except under CI (``CI=true``), where they
    fail; with the pack but without the ``gguf`` package (which the pack needs) they always fail."""
    root = tm.comfyui_path()
    path = os.path.join(root, "custom_nodes", GGUF_DIR)
    if not os.path.isfile(os.path.join(path, "__init__.py")):
        why = f"ComfyUI-GGUF is not unpacked in {os.path.join('$COMFYUI_PATH', 'custom_nodes', GGUF_DIR)}"
        if _in_ci():
            pytest.fail(f"{why} (CI installs it)")
        pytest.skip(why)
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        pytest.fail(f"ComfyUI-GGUF is in custom_nodes but the gguf package it needs is not installed: {e}")
    name = "ComfyUI_GGUF_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def write_gguf(path, sd, qtype_name, arch="sd3", quantizable=_quantizable):
    """A .gguf the way ComfyUI-GGUF's convert tool writes one: arch ``sd3`` (or ``arch``), block
    weights in ``qtype``, small or 1-D tensors in F32."""
    import gguf
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.GUESSED)
    for k, v in sd.items():
        a = v.float().numpy()
        if quantizable(k, v) and a.shape[-1] % block == 0:
            q = _k_quant_blocks(a, qtype) if qtype_name.endswith("_K") else gguf.quants.quantize(a, qtype)
            w.add_tensor(k, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(k, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _k_quant_blocks(a, qtype):
    """K-quant blocks for ``a``'s shape (the ``gguf`` package can read K-quants but not write
    them): seeded codes with small block scales, a valid Q4_K/Q6_K payload that the loader pack
    dequantises like any other (parity compares the same bytes with and without Max VRAM)."""
    import gguf
    import numpy as np
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = a.shape
    rng = np.random.default_rng(cols * 7919 + rows)
    q = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (f16) lead each block
        q[..., 0:2] = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
        q[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    else:  # Q6_K: int8 scales, then d (f16) at the end
        q[..., -2:] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return q.reshape(rows, -1)


def load_gguf_unet(tmp_path, name, sd, qtype):
    import folder_paths
    pack = gguf_pack()
    d = tmp_path / "unet_gguf"
    d.mkdir(exist_ok=True)
    write_gguf(d / name, sd, qtype)
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    folder_paths.folder_names_and_paths["unet_gguf"][0].append(str(d))
    folder_paths.filename_list_cache.clear() if hasattr(folder_paths, "filename_list_cache") else None
    return pack.nodes.UnetLoaderGGUF().load_unet(name)[0]


# --------------------------------------------------------------------------------------------
# the cases
# --------------------------------------------------------------------------------------------

def _ksample(model, pos, neg, steps=2):
    from nodes import KSampler
    empty = {"samples": torch.zeros(LATENT)}
    with torch.no_grad():
        return KSampler().sample(model, 7, steps, 2.0, "euler", "simple", pos, neg, empty, denoise=1.0)[0]["samples"]


FORMATS = ["fp8_scaled", "int8_tensorwise", "mxfp8", "nvfp4", "gguf_Q8_0", "gguf_Q4_K"]


def load_format(fmt, tmp_path):
    sd = tm.tiny_sd3_state_dict(depth=DEPTH, seed=0)
    if fmt.startswith("gguf_"):
        return load_gguf_unet(tmp_path, f"tiny_sd3_{fmt}.gguf", sd, fmt[len("gguf_"):])
    kitchen = {"fp8_scaled": "float8_e4m3fn"}.get(fmt, fmt)
    why = _kitchen_missing(kitchen)
    if why:
        pytest.skip(f"{fmt}: {why}")
    build = {"fp8_scaled": fp8_scaled_sd, "int8_tensorwise": int8_sd}.get(fmt) or (lambda s: kitchen_layout_sd(s, fmt))
    try:
        qsd = build(sd)
    except Exception as e:  # the host cannot quantise this format on CPU
        pytest.skip(f"{fmt}: the host cannot quantise it on CPU ({type(e).__name__}: {e})")
    return load_unet(save_unet(tmp_path, f"tiny_sd3_{fmt}.safetensors", qsd))


def quantized_params(model):
    return [p for p in model.model.diffusion_model.parameters() if type(p) not in (torch.Tensor, torch.nn.Parameter)]


def budget_for(model, share=0.45):
    from vramcut_core import find_units
    from vramcut_core.runtime.executor import SegmentedExecutor
    us = find_units(model.model.diffusion_model)
    ex = SegmentedExecutor(lambda n: next(u for u in us.units if u.name == n), "cpu")
    sizes = sorted((ex.unit_device_bytes(u.name) for u in us.units), reverse=True)
    total = sum(sizes)
    return max(total * share, sizes[0] + 2.2 * sizes[1] + (1 << 20)) / GIB


@pytest.fixture
def quantized(request, comfy, tmp_path):
    fmt = request.param
    model = load_format(fmt, tmp_path)
    pos, neg = tm.tiny_sd3_conditioning()
    try:
        _ksample(model, pos, neg, steps=1)
    except Exception as e:  # e.g. a block format whose kernels exist only on a GPU
        pytest.skip(f"{fmt}: ComfyUI cannot run it on CPU here ({type(e).__name__}: {e})")
    return fmt, model, pos, neg


@pytest.mark.parametrize("quantized", FORMATS, indirect=True)
def test_quantized_model_samples_bit_exact_with_stored_bytes_in_budget(quantized, max_vram, pack):
    fmt, model, pos, neg = quantized
    assert quantized_params(model), f"{fmt}: the loader produced no quantized weights"
    ref = _ksample(model, pos, neg)
    snap = snapshot(model.model.diffusion_model)
    gb = budget_for(model)
    (patched, _, _), payload = max_vram(gb, model=model)
    out = _ksample(patched, pos, neg)
    assert torch.equal(out, ref), f"{fmt}: max diff {(out - ref).abs().max()}"
    assert_same(model.model.diffusion_model, snap)
    plan = payload["models"][0]["plan"]
    assert plan["measured"] and plan["peak_bytes"] <= plan["budget_bytes"]
    assert plan["streamed_bytes_per_forward"] > 0
    assert not any("cannot be taken apart" in w for w in plan["warnings"]), plan["warnings"]
    # stored bytes: every unit's plan bytes are its parts, aligned, and no larger than its
    # stored size rounded up per tensor
    state = pack.nodes.patcher.state_of(patched)
    (engine,) = state._engines.values()
    for u in engine.unitset.units:
        lay = engine.executor.memory.layout(u.name)
        assert lay.other == [], f"{fmt}: {u.name} has tensors moved one by one"
        assert engine.executor.unit_device_bytes(u.name) <= u.weight_bytes + 256 * len(u.tensors) * 3
    stats = plan["stats"]
    assert stats["peak_device_bytes"] <= plan["budget_bytes"], f"{fmt}: measured peak over budget"
    # the executor's accounted weight bytes are the plan's (resident + window), never more
    assert stats["peak_weight_bytes"] <= plan["resident_bytes"] + plan["window_bytes"]
    print(f"\n{fmt}: units {[ (u.name, engine.executor.unit_device_bytes(u.name)) for u in engine.unitset.units]}"
          f" budget {plan['budget_bytes']} plan peak {plan['peak_bytes']} measured peak {stats['peak_device_bytes']}"
          f" weights on device {stats['peak_weight_bytes']}")


LORA_ROOM = 2 << 20
SMALLEST = re.compile(r"set max_vram_gb to (?:at least )?([0-9]+\.[0-9]+)")


def lora_budget(max_vram, model, run, node_id="probe"):
    """``budget_for(model)`` with room for the activations of a layer whose weights are
    dequantised and patched on the fly, or, where that is refused, the budget the pack names in
    the refusal (nvfp4: its dequantised, patched layers are many times their stored bytes)."""
    gb = budget_for(model) + LORA_ROOM / GIB
    (probe, _, _), _ = max_vram(gb, model=model, node_id=node_id)
    try:
        run(probe)
    except ValueError as e:
        m = SMALLEST.search(str(e))
        assert m and float(m.group(1)) > gb, str(e)
        return float(m.group(1))
    return gb


@pytest.mark.parametrize("order", ["lora_then_vramcut", "vramcut_then_lora"])
@pytest.mark.parametrize("quantized", FORMATS, indirect=True)
def test_quantized_lora_before_or_after_the_node(quantized, order, max_vram, forward_peaks):
    import comfy.sd

    fmt, model, pos, neg = quantized
    lora = tm.tiny_lora_for(tm.tiny_sd3_state_dict(depth=DEPTH, seed=0), seed=3)
    with_lora, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)
    ref = _ksample(with_lora, pos, neg)
    plain = _ksample(model, pos, neg)
    assert not torch.equal(ref, plain), "the LoRA must matter"
    if order == "lora_then_vramcut":
        gb = lora_budget(max_vram, with_lora, lambda p: _ksample(p, pos, neg))
        (patched, _, _), payload = max_vram(gb, model=with_lora)
    else:
        gb = lora_budget(max_vram, model, lambda p: _ksample(comfy.sd.load_lora_for_models(p, None, lora, 1.0, 0)[0],
                                                              pos, neg))
        (p0, _, _), payload = max_vram(gb, model=model)
        patched, _ = comfy.sd.load_lora_for_models(p0, None, lora, 1.0, 0)
        assert type(patched) is type(p0), "clones keep the VRAMCut patcher (and the loader's own)"
    del forward_peaks[:]
    assert torch.equal(_ksample(patched, pos, neg), ref), fmt
    assert len(forward_peaks) >= 2, forward_peaks   # one per step (CFG batched), each metered
    assert all(0 < peak <= budget for peak, budget in forward_peaks), f"{fmt}: {forward_peaks}"
    assert torch.equal(_ksample(model, pos, neg), plain), "the plain model must stay plain"
    assert payload["models"][0]["plan"]["streamed_bytes_per_forward"] > 0, "the budget must stream"
    print(f"\n{fmt} {order}: budget {gb} GiB, peaks {forward_peaks}")


@pytest.mark.parametrize("order", ["no_lora", "lora_then_vramcut", "vramcut_then_lora"])
def test_fp8_weight_dtype_of_the_unet_loader_samples_bit_exact(comfy, tmp_path, max_vram, order):
    """Plain fp8: a full-precision checkpoint loaded by UNETLoader with ``weight_dtype`` fp8_e4m3fn
    (the host casts the weights at load and computes in a wider dtype)."""
    import comfy.sd
    from nodes import UNETLoader

    sd = tm.tiny_sd3_state_dict(depth=DEPTH, seed=0)
    model = UNETLoader().load_unet(save_unet(tmp_path, "tiny_sd3_full.safetensors", sd), "fp8_e4m3fn")[0]
    assert any(p.dtype == torch.float8_e4m3fn for p in model.model.diffusion_model.parameters()), \
        "the loader did not store fp8 weights"
    pos, neg = tm.tiny_sd3_conditioning()
    lora = tm.tiny_lora_for(sd, seed=3)
    ref_model = model if order == "no_lora" else comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]
    ref = _ksample(ref_model, pos, neg)
    if order == "vramcut_then_lora":
        (p0, _, _), payload = max_vram(budget_for(model), model=model)
        patched = comfy.sd.load_lora_for_models(p0, None, lora, 1.0, 0)[0]
    else:
        (patched, _, _), payload = max_vram(budget_for(model), model=ref_model)
    assert torch.equal(_ksample(patched, pos, neg), ref), order
    plan = payload["models"][0]["plan"]
    assert plan["streamed_bytes_per_forward"] > 0


# --------------------------------------------------------------------------------------------
# a GGUF text encoder (ComfyUI-GGUF's CLIPLoaderGGUF)
# --------------------------------------------------------------------------------------------

# A T5 encoder in the T5 v1.1 / T5-XXL layout (gated GELU: wi_0, wi_1), shrunk: widths that
# K-quant blocks (256) divide, so every block weight is stored quantized.
GGUF_T5 = dict(tm.TINY_T5_CONFIG, d_model=256, d_ff=512, d_kv=32, num_heads=8, num_layers=4,
               dense_act_fn="gelu_pytorch_tanh", is_gated_act=True)
PROMPT = "a photo of a cat sitting on a red chair, highly detailed"


def llama_cpp_t5_names(sd, t5_map):
    """T5 encoder keys as llama.cpp names them in a .gguf (``enc.blk.0.attn_q.weight``), the
    inverse of the loader pack's own ``T5_SD_MAP``; every name is checked to map back."""
    out = {}
    for k, v in sd.items():
        name = k
        for src, dst in reversed(list(t5_map.items())):
            name = name.replace(dst, src)
        back = name
        for src, dst in t5_map.items():
            back = back.replace(src, dst)
        assert back == k, (k, name, back)
        out[name] = v
    return out


def load_gguf_clip(tmp_path, monkeypatch, name, qtype):
    """A tiny T5 .gguf (arch ``t5encoder``) loaded by ComfyUI-GGUF's ``CLIPLoaderGGUF`` node.

    The host detects a small T5 as T5-base and sizes it from its T5-base config file; the one
    thing changed in the node's path is that config, given the tiny sizes through the host's
    own ``t5base_model_config`` option (the weights, the GGML ops and the patcher are the
    loader pack's)."""
    import comfy.sd
    import folder_paths
    gg = gguf_pack()
    d = tmp_path / "clip_gguf"
    d.mkdir(exist_ok=True)
    sd = tm.tiny_t5_state_dict(seed=0, config=GGUF_T5)
    raw = llama_cpp_t5_names(sd, gg.loader.T5_SD_MAP)
    assert any(k.startswith("enc.blk.0.attn_q") for k in raw) and "token_embd.weight" in raw
    write_gguf(d / name, raw, qtype, arch="t5encoder",
               quantizable=lambda k, v: k.endswith(".weight") and v.ndim == 2 and min(v.shape) >= 32)
    folder_paths.add_model_folder_path("text_encoders", str(d))
    folder_paths.add_model_folder_path("clip", str(d))
    folder_paths.filename_list_cache.clear() if hasattr(folder_paths, "filename_list_cache") else None
    real = comfy.sd.load_text_encoder_state_dicts

    def tiny_t5_config(*args, model_options=None, **kwargs):
        return real(*args, model_options={**(model_options or {}), "t5base_model_config": dict(GGUF_T5)}, **kwargs)

    monkeypatch.setattr(comfy.sd, "load_text_encoder_state_dicts", tiny_t5_config)
    try:
        return gg.nodes.CLIPLoaderGGUF().load_clip(name, type="stable_audio")[0]
    finally:
        monkeypatch.setattr(comfy.sd, "load_text_encoder_state_dicts", real)


def tight_clip_budget(max_vram, c, tokens):
    """From a measured plan at a generous budget: what must stay resident (the token
    embedding), a window of 2.5 of the largest other block, the activations and a little;
    everything else streams."""
    (_, probe, _), payload = max_vram(1.0, clip=c)
    with torch.inference_mode():
        probe.encode_from_tokens(tokens)
    plan_json = payload["models"][0]["plan"]
    units = plan_json["units"]
    pinned = sum(u["weight_bytes"] for u in units if u["keep_resident"])
    rest = max(u["weight_bytes"] for u in units if not u["keep_resident"])
    return (pinned + 2.5 * rest + plan_json["activation_reserve_bytes"] + (64 << 10)) / GIB


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_text_encoder_encodes_bit_exact_with_stored_bytes_in_budget(comfy, tmp_path, monkeypatch,
                                                                         max_vram, pack, qtype):
    c = load_gguf_clip(tmp_path, monkeypatch, f"tiny_t5_{qtype}.gguf", qtype)
    module = c.cond_stage_model
    quant = [p for p in module.parameters() if getattr(p, "tensor_type", None) is not None
             and p.tensor_type.name == qtype]
    assert len(quant) >= 4 * 7, f"the loader kept {len(quant)} {qtype} weights"
    tokens = c.tokenize(PROMPT)
    with torch.inference_mode():
        ref = c.encode_from_tokens(tokens)
    snap = snapshot(module)
    (_, patched, _), payload = max_vram(tight_clip_budget(max_vram, c, tokens), clip=c)
    # the loader pack's patcher behaviour is kept under VRAMCut's
    assert type(patched.patcher).__name__.startswith("VRAMCut")
    assert isinstance(patched.patcher, gguf_pack().nodes.GGUFModelPatcher)
    with torch.inference_mode():
        out = patched.encode_from_tokens(tokens)
    assert torch.equal(out, ref), f"{qtype}: max diff {(out - ref).abs().max()}"
    assert_same(module, snap)
    plan = payload["models"][0]["plan"]
    assert plan["measured"] and plan["streamed_bytes_per_forward"] > 0
    assert not any("cannot be taken apart" in w for w in plan["warnings"]), plan["warnings"]
    assert plan["stats"]["peak_device_bytes"] <= plan["budget_bytes"], "measured peak over budget"
    state = pack.nodes.patcher.state_of(patched.patcher)
    (engine,) = state._engines.values()
    for u in engine.unitset.units:  # the stored bytes, one flat copy per unit
        assert engine.executor.memory.layout(u.name).other == [], f"{u.name} has tensors moved one by one"
        assert engine.executor.unit_device_bytes(u.name) <= u.weight_bytes + 256 * len(u.tensors) * 3
    print(f"\nCLIP {qtype}: units {[(u.name, engine.executor.unit_device_bytes(u.name)) for u in engine.unitset.units]}"
          f" budget {plan['budget_bytes']} plan peak {plan['peak_bytes']}"
          f" measured peak {plan['stats']['peak_device_bytes']}")


@pytest.mark.parametrize("budget", ["all_resident", "streamed"])
@pytest.mark.parametrize("order", ["lora_then_vramcut", "vramcut_then_lora"])
def test_gguf_text_encoder_lora_before_or_after_the_node(comfy, tmp_path, monkeypatch, max_vram, order, budget):
    """The LoRA reaches the quantized weights (the loader pack keeps it on each weight and
    applies it when it dequantises) and the plain ones (the relative attention bias, which the
    loader pack's patcher merges on the host at every load), once, at every encode: the host
    skips modules an earlier full load marked for casting, and its forced merge would stack on
    the last one, unless VRAMCut's load starts each module clean."""
    import comfy.sd

    c = load_gguf_clip(tmp_path, monkeypatch, "tiny_t5_lora_Q8_0.gguf", "Q8_0")
    # ComfyUI maps "text_encoders.<state dict key>" LoRA keys onto a CLIP's weights; the
    # shapes are the unquantized ones
    lora = tm.tiny_lora_for(tm.tiny_t5_state_dict(seed=0, config=GGUF_T5), seed=5,
                            prefix="text_encoders.t5base.transformer.", key_filter=lambda k: ".block." in k)
    tokens = c.tokenize(PROMPT)
    _, with_lora = comfy.sd.load_lora_for_models(None, c, lora, 0.0, 1.0)
    with torch.inference_mode():
        ref, plain = with_lora.encode_from_tokens(tokens), c.encode_from_tokens(tokens)
    assert not torch.equal(ref, plain), "the LoRA must matter"
    assert any("relative_attention_bias" in k for k in lora), "a plain weight is patched too"
    gb = 1.0 if budget == "all_resident" else tight_clip_budget(max_vram, c, tokens)
    if order == "lora_then_vramcut":
        (_, patched, _), _ = max_vram(gb, clip=with_lora)
    else:
        (_, p0, _), _ = max_vram(gb, clip=c)
        _, patched = comfy.sd.load_lora_for_models(None, p0, lora, 0.0, 1.0)
        assert type(patched).__name__ == "VRAMCutCLIP"
    with torch.inference_mode():
        for call in ("first", "second"):
            out = patched.encode_from_tokens(tokens)
            assert torch.equal(out, ref), (f"{call} encode: max diff {(out - ref).abs().max()}, "
                                           f"to the CLIP without LoRA {(out - plain).abs().max()}")
        assert torch.equal(c.encode_from_tokens(tokens), plain), "the plain CLIP must stay plain"
        assert torch.equal(with_lora.encode_from_tokens(tokens), ref), "the LoRA CLIP must stay as it was"
