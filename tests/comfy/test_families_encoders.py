"""The unit registry on the REAL ComfyUI text encoders, VAE, CLIP vision and (spandrel) ESRGAN.

Each case is the module VRAMCut's nodes hand to the engine (``CLIP.cond_stage_model``,
``VAE.first_stage_model``, ``ClipVisionModel.model``, the spandrel descriptor's ``.model``) or the
bare ComfyUI class it wraps, built tiny on CPU with seeded weights (randn * 0.02; the loader-built
ones carry tiny_models' seeded weights). Checked: the family, the layer units in order, prelude /
final units, every parameter and buffer in exactly one unit, and, where cheap, that the forward
through ``Engine`` equals the plain forward bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import pytest
import torch

import tiny_models as tm
from unit_checks import assert_partition, assert_peak_within_budget, blocks

try:
    tm.import_comfy()
except tm.ComfyUINotFound as e:  # pragma: no cover - depends on the host
    pytest.skip(str(e), allow_module_level=True)

import comfy.clip_model  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.sd1_clip  # noqa: E402
import comfy.text_encoders.llama  # noqa: E402
import comfy.text_encoders.t5  # noqa: E402

OPS = comfy.ops.disable_weight_init


# ---------------------------------------------------------------------------------------------
# helpers (the same rules as test_families.py)


def seeded(m: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.device.type != "meta":
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
    return m.eval()


def same(a, b) -> bool:
    """Bit-identical, through the tuples / lists / dicts the encoders return."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


MARGIN = 4 * 1024


def engine_budget(us, activation_bytes: int) -> int:
    """About 40% of the weights, raised to leave 2.5x the largest unit, plus the measured
    activation reserve and a margin."""
    biggest = max(u.weight_bytes for u in us.units)
    return max(int(us.weight_bytes * 0.4), int(biggest * 2.5)) + activation_bytes + MARGIN


def run(eng, fn, args):
    """Token lists are not tensors: those calls pass their signature explicitly."""
    if any(isinstance(a, torch.Tensor) for a in args):
        return eng.run(fn, *args)
    return eng.run_as(("tokens", repr(args)), fn, *args)


def check_engine(core, module, fn, args, cuts: bool):
    with torch.no_grad():
        ref = fn(*args)
        probe = core.Engine(module, core.EngineConfig(budget_bytes=1 << 40, device="cpu"))
        assert same(run(probe, fn, args), ref)
        budget = engine_budget(probe.unitset, probe.last_plan.activation_reserve_bytes)
        eng = core.Engine(module, core.EngineConfig(budget_bytes=budget, device="cpu"))
        out = run(eng, fn, args)
        again = run(eng, fn, args)
    assert same(out, ref)
    assert same(again, ref)
    plan = eng.last_plan
    assert plan.measured and plan.peak_bytes <= budget
    assert_peak_within_budget(eng.stats, budget)
    if cuts:
        assert plan.streamed_bytes_per_forward > 0, "everything resident: the budget did not cut"
    return eng


# ---------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Case:
    id: str
    build: Callable[[], torch.nn.Module]
    family: str
    block_names: list[str]
    forward: Callable[[torch.nn.Module], tuple[Callable, tuple]] | None = None
    cuts: bool = True  # False: one unit (a 49k-token embedding) is most of the tiny model
    prelude: bool = True
    final: bool = True


def _json(*parts) -> dict:
    with open(os.path.join(*parts)) as f:
        return json.load(f)


COMFY_DIR = os.path.dirname(os.path.realpath(comfy.sd1_clip.__file__))
TINY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 3,
             "projection_dim": 32}
TINY_T5 = {"d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 4}
TINY_LLM = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}


def _tokens(n=8, vocab=256, seed=1):
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# -- text encoders built by ComfyUI's loaders: comfy.sd.CLIP.cond_stage_model

def _sd_clip_l():
    clip = tm.load_tiny_clip_l(config=TINY_CLIP)
    _sd_clip_l.clip = clip
    return clip.cond_stage_model  # sd1_clip.SD1ClipModel -> clip_l: SDClipModel -> CLIPTextModel


def _sd_clip_l_forward(m):
    return m.encode_token_weights, (_sd_clip_l.clip.tokenize("a photo of a cat"),)


def _sd_t5():
    clip = tm.load_tiny_t5()  # text_encoders.sa_t5.SAT5Model -> t5base: SDClipModel -> T5
    _sd_t5.clip = clip
    return clip.cond_stage_model


def _sd_t5_forward(m):
    return m.encode_token_weights, (_sd_t5.clip.tokenize("a photo of a cat"),)


def _flux_te():
    # the Flux text encoder: CLIP-L + T5-XXL (t5_config_xxl.json: gated gelu), both shrunk through
    # the model_options ComfyUI's SDClipModel reads ("<name>_model_config"); manual_cast operations
    from comfy.text_encoders.flux import FluxClipModel
    m = FluxClipModel(device="cpu", dtype=torch.float32, dtype_t5=torch.float32,
                      model_options={"clip_l_model_config": dict(TINY_CLIP, num_hidden_layers=2),
                                     "t5xxl_model_config": dict(TINY_T5, num_layers=2)})
    return seeded(m)


def _flux_te_forward(m):
    from comfy.text_encoders.flux import FluxTokenizer
    return m.encode_token_weights, (FluxTokenizer().tokenize_with_weights("a photo of a cat"),)


# -- the bare ComfyUI classes

def _clip_text():
    cfg = _json(COMFY_DIR, "sd1_clip_config.json")
    cfg.update(TINY_CLIP)
    return seeded(comfy.clip_model.CLIPTextModel(cfg, torch.float32, "cpu", OPS))


def _clip_text_forward(m):
    tok = _tokens(77, 49406)
    tok[0, 0], tok[0, 9:] = 49406, 49407  # start, text, end + padding
    return m, (tok,)


def _t5():
    cfg = _json(COMFY_DIR, "text_encoders", "t5_config_xxl.json")
    cfg.update(TINY_T5, vocab_size=256)
    return seeded(comfy.text_encoders.t5.T5(cfg, torch.float32, "cpu", OPS))


def _t5_forward(m):
    return (lambda ids: m(ids, None)), (_tokens(),)


def _llama():
    return seeded(comfy.text_encoders.llama.Llama2(dict(TINY_LLM), torch.float32, "cpu", OPS))


def _llama_forward(m):
    return m, (_tokens(),)


def _qwen25_vl():
    # Qwen-Image's text encoder. Its vision tower (text_encoders.qwen_vl.Qwen2VLVisionTransformer)
    # is built at full size whatever the config (hidden 1280, 32 blocks, ~660M weights), so the
    # model goes on the meta device: units need the structure, not the values. No forward.
    return comfy.text_encoders.llama.Qwen25_7BVLI(dict(TINY_LLM), torch.float32, "meta", OPS)


# -- VAE, CLIP vision, ESRGAN

def _sd_vae():
    return tm.load_tiny_vae().first_stage_model  # ldm.models.autoencoder.AutoencoderKL


def _vae_decode(m):
    return m.decode, (torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)),)


def _vae_encode(m):
    return m.encode, (torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1,)


def _autoencoder_kl():
    from comfy.ldm.models.autoencoder import AutoencoderKL
    # ddconfig builds ldm.modules.diffusionmodules.model.Encoder / Decoder; 3 levels here
    cfg = tm.tiny_vae_config(ch_mult=(1, 2, 2))
    return seeded(AutoencoderKL(**cfg["params"]))


def _clip_vision():
    return tm.load_tiny_clip_vision().model  # clip_model.CLIPVisionModelProjection


def _clip_vision_forward(m):
    return m, (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)),)


def _esrgan():
    from spandrel import ModelLoader
    # tiny_models.load_tiny_esrgan has one RRDB; three give a block list worth cutting
    sd = tm.tiny_esrgan_state_dict(seed=0, num_blocks=3)
    return ModelLoader().load_from_state_dict(sd).eval().model  # spandrel ESRGAN (RRDBNet)


def _esrgan_forward(m):
    return m, (torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)


VAE_BLOCKS = (blocks("encoder.down", 4) + ["encoder.mid", "decoder.mid"] + blocks("decoder.up", 4))

CASES = [
    Case("sd_clip_l", _sd_clip_l, "text_encoder", blocks("clip_l.transformer.text_model.encoder.layers", 3),
         _sd_clip_l_forward, cuts=False),
    Case("sd_t5base", _sd_t5, "text_encoder", blocks("t5base.transformer.encoder.block", 2), _sd_t5_forward,
         cuts=False),
    Case("flux_te_clip_l_t5xxl", _flux_te, "text_encoder",
         blocks("clip_l.transformer.text_model.encoder.layers", 2) + blocks("t5xxl.transformer.encoder.block", 2),
         _flux_te_forward, cuts=False),
    Case("clip_text", _clip_text, "text_encoder", blocks("text_model.encoder.layers", 3), _clip_text_forward,
         cuts=False),
    Case("t5xxl", _t5, "text_encoder", blocks("encoder.block", 4), _t5_forward),
    Case("llama", _llama, "text_encoder", blocks("model.layers", 3), _llama_forward),
    Case("sd_vae_decode", _sd_vae, "sd_vae", VAE_BLOCKS, _vae_decode),
    Case("sd_vae_encode", _sd_vae, "sd_vae", VAE_BLOCKS, _vae_encode),
    Case("autoencoder_kl", _autoencoder_kl, "sd_vae",
         blocks("encoder.down", 3) + ["encoder.mid", "decoder.mid"] + blocks("decoder.up", 3), _vae_decode),
    Case("clip_vision", _clip_vision, "text_encoder", blocks("vision_model.encoder.layers", 2),
         _clip_vision_forward),
    Case("esrgan", _esrgan, "esrgan", blocks("model.1.sub", 4), _esrgan_forward),
]

_BUILT: dict[Callable, torch.nn.Module] = {}


def built(case: Case) -> torch.nn.Module:
    if case.build not in _BUILT:
        torch.manual_seed(0)
        _BUILT[case.build] = case.build()
    return _BUILT[case.build]


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_units(pack, case):
    m = built(case)
    us = pack.vramcut_core.find_units(m)
    assert us.family == case.family, (us.family, us.warnings)
    assert us.warnings == []
    assert [u.name for u in us.units if u.kind == "block"] == case.block_names
    kinds = [u.kind for u in us.units]
    assert ("prelude" in kinds) == case.prelude, kinds
    assert ("final" in kinds) == case.final, kinds
    assert_partition(m, us)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_engine_forward_bit_identical(pack, case):
    m = built(case)
    fn, args = case.forward(m)
    check_engine(pack.vramcut_core, m, fn, args, case.cuts)


def test_vae_decode_then_encode_on_one_engine(pack):
    """One engine for the VAE (as the node keeps one): a decode, then an encode (a new signature:
    planned again), each bit-identical; during the decode the encoder units are not entered."""
    core = pack.vramcut_core
    m = built(CASES[[c.id for c in CASES].index("sd_vae_decode")])
    us = core.find_units(m)
    biggest = max(u.weight_bytes for u in us.units)
    eng = core.Engine(m, core.EngineConfig(budget_bytes=int(biggest * 2.5) + (8 << 20), device="cpu"))
    (dec, dargs), (enc, eargs) = _vae_decode(m), _vae_encode(m)
    with torch.no_grad():
        assert torch.equal(eng.run(dec, *dargs), dec(*dargs))
        entered = set(eng.measurements[eng.last_signature])
        assert not any(n.startswith("encoder.") for n in entered), entered
        assert {"decoder.mid", "decoder.up.0"} <= entered
        assert torch.equal(eng.run(enc, *eargs), enc(*eargs))
        assert len(eng.measurements) == 2


# -- Qwen2.5-VL (Qwen-Image's text encoder): the text layers and the vision tower's blocks


def test_qwen25_vl_text_layers_and_partition(pack):
    m = built(Case("qwen25_vl", _qwen25_vl, "text_encoder", []))
    us = pack.vramcut_core.find_units(m)
    assert us.family == "text_encoder"
    assert [u.name for u in us.units if u.name.startswith("model.layers.")] == blocks("model.layers", 3)
    assert_partition(m, us)


def test_qwen25_vl_vision_blocks_are_units(pack):
    m = built(Case("qwen25_vl", _qwen25_vl, "text_encoder", []))
    us = pack.vramcut_core.find_units(m)
    names = [u.name for u in us.units if u.kind == "block"]
    assert names == blocks("model.layers", 3) + blocks("visual.blocks", len(m.visual.blocks)) or \
        names == blocks("visual.blocks", len(m.visual.blocks)) + blocks("model.layers", 3)
    assert max(u.weight_bytes for u in us.units) < us.weight_bytes // 8
