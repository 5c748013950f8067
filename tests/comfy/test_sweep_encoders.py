"""The sweep of the host's LLM text encoders: every one built small, cut, run bit-identical.

The classes are found at run time: every ``torch.nn.Module`` in ``comfy.text_encoders.*`` that
derives from ``comfy.text_encoders.llama.BaseLlama`` (Llama, Mistral for Flux.2, Qwen2.5 /
Qwen2.5-VL, Qwen3, Gemma 2/3/4, Ovis ...). Each is built with the host's own class and
operations; its configuration dataclass (read from the constructor's source: ``XConfig(**config_dict)``)
gets tiny widths and two layers. Sizes the host keeps as class attributes rather than fields
(``head_dim``, a vision tower's config) are lowered on the class for the build only, and a vision
tower built at a fixed width (Qwen2.5-VL's) is built from its own class with small arguments.

Checked for each: the ``text_encoder`` family with no warning, the decoder layers as units (and
the vision tower's blocks where there is one), every parameter and buffer in one unit, and the
forward through ``Engine`` under a streaming budget equal to the plain one bit for bit (text; and
the image path where the encoder has a vision tower, as image-edit prompts use it).

Each streamed run also holds the dry run's per-unit activation peaks (``trace``) against the CPU
meter's of the same forward (``unit_checks.trace_bound``); a path the dry run cannot run is listed
in :data:`UNTRACED` with the reason.

A class that cannot be built small is listed in :data:`NOT_BUILT` with the reason; the
completeness test fails when the host has a class in neither list.

The Qwen-Image, Flux.2 and Z-Image encoders also run through the host's loader
(``comfy.sd.load_text_encoder_state_dicts`` with the tiny config in ``model_options``) and the
Max VRAM node's CLIP patch, compared with the unpatched CLIP.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import sys

import pytest
import torch

_here = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(os.path.dirname(_here)), os.path.dirname(_here), _here):  # helpers by name
    if _p not in sys.path:
        sys.path.append(_p)

import tiny_models as tm  # noqa: E402
from unit_checks import assert_partition, assert_trace_bound, trace_text  # noqa: E402

try:
    tm.import_comfy()
except tm.ComfyUINotFound as e:  # pragma: no cover - depends on the host
    pytest.skip(str(e), allow_module_level=True)

import comfy.ops  # noqa: E402
import comfy.text_encoders  # noqa: E402
import comfy.text_encoders.llama as llama  # noqa: E402

import test_families_encoders as tfe  # noqa: E402  (seeded weights, parity through Engine)

OPS = comfy.ops.disable_weight_init

# Tiny values by configuration name; only the names a class's configuration has are used.
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=128,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, moe_intermediate_size=32,
            num_experts=2, num_experts_per_tok=1, num_kv_shared_layers=0)
# A vision tower's size (the Gemma 3 SigLIP config, the Qwen2.5-VL tower's arguments)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2,
                   image_size=224, patch_size=14)  # 16x16 patches: the projector pools to 16 tokens a side
TINY_QWEN_VL = dict(hidden_size=32, intermediate_size=64, num_heads=2, num_layers=2)

# Classes that cannot be built small on CPU, with the reason (checked against the host).
_QWEN3VL = ("the configuration comes from a per-model table (QWEN3VL_CONFIGS[model_type]) and the vision "
            "tower from module tables at full width; a small build would patch those tables (not written yet)")
_GEMMA4 = ("the vision and audio encoders take their sizes from module-level configs the text config does "
           "not reach (about 300M parameters with a two-layer text model); not written yet")
NOT_BUILT: dict[str, str] = {
    "qwen3vl.Qwen3VL": _QWEN3VL,
    "joyimage.Qwen3VL8B_JoyImage": _QWEN3VL,
    "minimax.MiniMaxQwen3VL": _QWEN3VL,
    "qwen35.Qwen35": "the configuration is built by a per-model table (_make_config); linear-attention layers "
                     "and a full-width vision tower; not written yet",
    "gemma4.Gemma4_E2B": _GEMMA4,
    "gemma4.Gemma4_E4B": _GEMMA4,
    "gemma4.Gemma4_12B": _GEMMA4,
    "gemma4.Gemma4_31B": _GEMMA4,
}


# Forwards the dry run cannot run (the engine measures their first forward instead), by class and
# path ("text", "image"), with the reason.
UNTRACED: dict[tuple[str, str], str] = {
    ("llama.Qwen25_7BVLI", "image"): "the vision tower sizes its windows from the patch grid's values "
                                     "(.item(), .tolist(): shapes depend on the data)",
}


def encoder_classes() -> dict[str, type]:
    found = {}
    for info in pkgutil.iter_modules(comfy.text_encoders.__path__):
        try:
            mod = importlib.import_module(f"comfy.text_encoders.{info.name}")
        except Exception:  # a module needing an optional package: its classes are not found
            continue
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and obj.__module__ == mod.__name__ and issubclass(obj, torch.nn.Module)
                    and issubclass(obj, llama.BaseLlama)
                    and list(inspect.signature(obj.__init__).parameters)[1:5] == ["config_dict", "dtype", "device",
                                                                                  "operations"]):
                found[f"{mod.__name__.rsplit('.', 1)[1]}.{name}"] = obj
    return dict(sorted(found.items()))


CLASSES = encoder_classes()


def config_class(cls):
    """The configuration dataclass the constructor fills from ``config_dict``."""
    src = inspect.getsource(cls.__init__)
    m = re.search(r"(\w+)\(\*\*config_dict\)", src)
    if m is None:
        return None
    scope = inspect.getclosurevars(cls.__init__)  # a class made by a factory: the config is a free variable
    found = scope.nonlocals.get(m.group(1), scope.globals.get(m.group(1)))
    return found if dataclasses.is_dataclass(found) else None


@contextlib.contextmanager
def small_class_sizes(cfg_cls):
    """Lower the sizes a configuration keeps as class attributes (not fields) for one build."""
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    saved = []
    try:
        for k, v in TINY.items():
            if k not in fields and hasattr(cfg_cls, k) and isinstance(getattr(cfg_cls, k), int):
                saved.append((k, getattr(cfg_cls, k)))
                setattr(cfg_cls, k, v)
        vis = getattr(cfg_cls, "vision_config", None)
        if isinstance(vis, dict) and "vision_config" not in fields:
            saved.append(("vision_config", vis))
            cfg_cls.vision_config = dict(vis, **{k: v for k, v in TINY_VISION.items() if k in vis})
        vl = getattr(sys.modules["comfy.text_encoders.qwen_vl"] if "comfy.text_encoders.qwen_vl" in sys.modules
                     else None, "Qwen2VLVisionTransformer", None)
        if vl is not None:
            qwen_vl = sys.modules["comfy.text_encoders.qwen_vl"]
            params = inspect.signature(vl.__init__).parameters

            def small_vl(*a, **kw):
                kw.update({k: v for k, v in TINY_QWEN_VL.items() if k in params})
                return vl(*a, **kw)

            qwen_vl.Qwen2VLVisionTransformer = small_vl
            saved.append((None, vl))
        yield
    finally:
        for k, v in reversed(saved):
            if k is None:
                sys.modules["comfy.text_encoders.qwen_vl"].Qwen2VLVisionTransformer = v
            elif dataclasses.is_dataclass(cfg_cls) and k in cfg_cls.__dict__:
                setattr(cfg_cls, k, v)
            else:
                setattr(cfg_cls, k, v)


def tiny_config(cls) -> dict:
    cfg_cls = config_class(cls)
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    return {k: v for k, v in TINY.items() if k in fields}


def build(cls) -> torch.nn.Module:
    with small_class_sizes(config_class(cls)):
        torch.manual_seed(0)
        m = cls(tiny_config(cls), torch.float32, "cpu", OPS)
    return tfe.seeded(m)


def vision_tower(m) -> str | None:
    for name in ("visual", "vision_model"):
        if getattr(m, name, None) is not None:
            return name
    return None


_BUILT: dict[str, torch.nn.Module] = {}


def built(name: str) -> torch.nn.Module:
    if name not in _BUILT:
        _BUILT.clear()
        _BUILT[name] = build(CLASSES[name])
    return _BUILT[name]


SWEPT = [n for n in CLASSES if n not in NOT_BUILT]


def test_every_llm_encoder_is_swept_or_listed():
    assert CLASSES, "no LLM text-encoder class found on the host"
    # the table may name classes a host does not have (it lists the newest host's); each class of
    # this host is swept or listed
    for name in CLASSES:
        assert config_class(CLASSES[name]) is not None or name in NOT_BUILT, name


@pytest.mark.parametrize("name", SWEPT)
def test_llm_encoder_units_and_parity(pack, name):
    core = pack.vramcut_core
    m = built(name)
    n_params = sum(p.numel() for p in m.parameters())
    assert n_params < 5_000_000, f"{name} did not build small: {n_params} parameters"
    us = core.find_units(m)
    assert us.family == "text_encoder", (us.family, us.warnings)
    assert us.warnings == []
    layers = [u.name for u in us.units if u.name.startswith("model.layers.")]
    assert layers == [f"model.layers.{i}" for i in range(len(m.model.layers))] and len(layers) == 2
    tower = vision_tower(m)
    if tower == "visual":  # Qwen2.5-VL / Qwen3-VL: the tower's blocks are units
        assert any(u.name.startswith("visual.blocks.") for u in us.units)
    assert_partition(m, us)
    tokens = torch.randint(2, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    assert_trace_bound(check_streamed(core, m, m, tokens), f"{name} (text)", (name, "text") in UNTRACED)


def check_streamed(core, m, fn, *args):
    """``fn(*args)`` plain, then through ``Engine`` at a budget below the weights the forward
    runs (2.5x the largest unit, or just under them where two layers are most of a tiny encoder):
    bit-identical, and something streamed."""
    with torch.no_grad():
        ref = fn(*args)
        probe = core.Engine(m, core.EngineConfig(budget_bytes=1 << 40, device="cpu"))
        assert tfe.same(probe.run(fn, *args), ref)
        act = probe.last_plan.activation_reserve_bytes
        # sized over the units this forward runs (a text prompt never enters the vision tower,
        # and units a forward never enters take no room in the plan)
        ran = [u.weight_bytes for u in probe.last_plan.units if u.entered]
        budget = min(max(int(sum(ran) * 0.4), int(max(ran) * 2.5)) + act + tfe.MARGIN, sum(ran) + act - 1)
        eng = core.Engine(m, core.EngineConfig(budget_bytes=budget, device="cpu"))
        assert tfe.same(eng.run(fn, *args), ref)
        assert tfe.same(eng.run(fn, *args), ref)
    plan = eng.last_plan
    assert plan.measured and plan.peak_bytes <= budget
    assert plan.streamed_bytes_per_forward > 0, "everything resident: the budget did not cut"
    return probe


_VISION = [n for n in SWEPT if n.split(".")[1] in {"Qwen25_7BVLI", "Gemma3_4B_Vision"}]


@pytest.mark.parametrize("name", _VISION)
def test_llm_encoder_vision_tower_parity(pack, name):
    """The image path (an image-edit prompt's picture) through the vision tower, cut."""
    core = pack.vramcut_core
    m = built(name)
    img = torch.rand(1, 56, 56, 3, generator=torch.Generator().manual_seed(2))

    def encode_image(image):
        return m.preprocess_embed({"type": "image", "data": image}, "cpu")[0]

    probe = check_streamed(core, m, encode_image, img)
    assert_trace_bound(probe, f"{name} (image)", (name, "image") in UNTRACED)
    entered = set(probe.measurements[probe.last_signature])
    assert any(n.startswith(vision_tower(m) + ".") for n in entered), entered


# ---------------------------------------------------------------------------------------------
# through the host's loader and the Max VRAM node's CLIP patch


def _qwen_image_clip():
    """Qwen-Image's encoder (Qwen2.5-VL) as ``CLIPLoader`` builds it: weights of a small
    ``Qwen25_7BVLI`` handed to ``comfy.sd.load_text_encoder_state_dicts`` (type ``qwen_image``)
    with the small configuration in ``model_options``. Four key/value heads of the host's
    head size make the 512-wide ``k_proj`` bias by which the loader recognises Qwen2.5-7B; the
    vocabulary stays the real one (the tokenizer's ids reach 151k)."""
    import comfy.sd
    cls = CLASSES["llama.Qwen25_7BVLI"]
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=4)
    with small_class_sizes(config_class(cls)):  # the vision tower: small, when built and when loaded
        torch.manual_seed(0)
        m = tfe.seeded(cls(dict(cfg), torch.float32, "cpu", OPS))
        sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
        assert sd["model.layers.0.self_attn.k_proj.bias"].shape[0] == 512
        clip = comfy.sd.load_text_encoder_state_dicts([sd], clip_type=comfy.sd.CLIPType.QWEN_IMAGE,
                                                      model_options={"qwen25_7b_model_config": dict(cfg)})
    tr = clip.cond_stage_model.qwen25_7b.transformer
    assert type(tr) is cls and len(tr.model.layers) == 3
    for k, v in tr.state_dict().items():  # the loader took every weight
        assert torch.equal(v, sd[k]), k
    return clip


@pytest.mark.skipif("llama.Qwen25_7BVLI" not in CLASSES or not hasattr(__import__("comfy.sd").sd.CLIPType, "QWEN_IMAGE"),
                    reason="the host has no Qwen-Image text encoder")
@pytest.mark.parametrize("with_image", [False, True], ids=["text", "edit_image"])
def test_qwen_image_encoder_through_loader_and_node(comfy, max_vram, with_image):
    import test_clip_vae_path as cvp
    clip = _qwen_image_clip()
    with torch.inference_mode():
        if with_image:  # what TextEncodeQwenImageEdit tokenizes: the prompt with the picture
            img = torch.rand(1, 56, 56, 3, generator=torch.Generator().manual_seed(3))
            tokens = clip.tokenize("make the cat blue", images=[img])
        else:
            tokens = clip.tokenize("a photo of a cat sitting on a red chair")
        ref, ref_pooled = clip.encode_from_tokens(tokens, return_pooled=True)
        (_, probe, _), probe_payload = max_vram(1.0, clip=clip)
        probe.encode_from_tokens(tokens, return_pooled=True)
        plan = cvp.entry(probe_payload, "CLIP")["plan"]
        (_, patched, _), payload = max_vram(cvp.tight_budget_gb(plan), clip=clip)
        cond, pooled = patched.encode_from_tokens(tokens, return_pooled=True)
    assert torch.equal(cond, ref)
    assert (pooled is None and ref_pooled is None) or torch.equal(pooled, ref_pooled)
    e = cvp.entry(payload, "CLIP")
    assert e["stage"] == "measured" and e["plan"]["streamed_bytes_per_forward"] > 0
    assert e["plan"]["peak_bytes"] <= e["plan"]["budget_bytes"]
    names = [u["name"] for u in e["plan"]["units"]]
    assert any(".model.layers." in n for n in names)
    if with_image:  # the picture went through the vision tower's blocks, cut
        assert any(".visual.blocks." in n for n in names)


# ---------------------------------------------------------------------------------------------
# the coverage table (``python tests/comfy/test_sweep_encoders.py``)


def main() -> None:
    import vramcut_core as core
    host = os.path.basename(os.path.dirname(tm.comfyui_path())) or tm.comfyui_path()
    print(f"#### LLM text encoders, host {host}\n")
    print("| class | cut by | units (small build) | parity | traced / measured activation peak per unit "
          "(min–max) |\n|---|---|---|---|---|")
    for name, cls in CLASSES.items():
        if name in NOT_BUILT:
            print(f"| {name} | not swept | | {NOT_BUILT[name]} | |")
            continue
        m = built(name)
        us = core.find_units(m)
        lists = dict.fromkeys(u.name.rsplit(".", 1)[0] for u in us.units if u.kind == "block")
        units = f"{len(us.units)} ({sum(u.kind == 'block' for u in us.units)} blocks in " \
                f"{', '.join(f'`{q}`' for q in lists)})"
        trace = ""
        try:
            tokens = torch.randint(2, 256, (1, 8), generator=torch.Generator().manual_seed(1))
            trace = "text " + trace_text(check_streamed(core, m, m, tokens))
            parity = "bit-identical, streamed"
            if name in _VISION:
                img = torch.rand(1, 56, 56, 3, generator=torch.Generator().manual_seed(2))
                encode = lambda image: m.preprocess_embed({"type": "image", "data": image}, "cpu")[0]  # noqa: E731
                trace += "; image " + trace_text(check_streamed(core, m, encode, img))
        except AssertionError:
            parity = "DIFFERS"
        how = f"registry: {us.label}" if us.family != "generic" else "generic fallback"
        print(f"| {name} | {how} | {units} | {parity} | {trace} |")


if __name__ == "__main__":
    main()
