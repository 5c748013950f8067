"""The unit registry on the REAL ComfyUI diffusion-model classes, built tiny on CPU.

Each case instantiates the class ComfyUI itself uses (``comfy.ldm...``) with a small but valid
configuration (``operations=comfy.ops.disable_weight_init``, float32, CPU), fills every parameter
with seeded ``randn * 0.02`` (disable_weight_init leaves them uninitialised), and checks:

* ``find_units`` names the expected family and no warning (the generic fallback: a warning);
* the block units are exactly the expected block lists, in the registry's order;
* prelude / final units exist where the model has embedders / output layers;
* every parameter and buffer is in exactly one unit;
* the forward (every case here is cheap on CPU): plain, and through ``Engine`` at about 40% of
  the weights (raised to 2.5x the largest unit where that is more) plus the activation reserve a
  first measured run found, is bit-identical, and the engine really streamed;
* in the measured forward each unit is entered once, embedders registered after the blocks
  included (``RUN_BEFORE_BLOCKS``), and the plan follows the order the forward ran.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

import tiny_models as tm
from unit_checks import assert_partition, assert_peak_within_budget, blocks

try:
    tm.import_comfy()
except tm.ComfyUINotFound as e:  # pragma: no cover - depends on the host
    pytest.skip(str(e), allow_module_level=True)

import comfy.ops  # noqa: E402

OPS = comfy.ops.disable_weight_init
F32 = dict(dtype=torch.float32, device="cpu", operations=OPS)


# ---------------------------------------------------------------------------------------------
# helpers


def seeded(m: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter (and float buffer) with seeded randn * 0.02; eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for _, b in m.named_buffers():
            if b.dtype.is_floating_point:
                b.copy_(torch.randn(b.shape, generator=g) * 0.02)
    return m.eval()


def rand(g: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


MARGIN = 4 * 1024


# Fields that newer hosts added to the model parameter dataclasses, with the values ComfyUI's own
# model detection gives the classic checkpoints (Flux.1, Chroma, HunyuanVideo 1.0).
CLASSIC_DEFAULTS = dict(txt_ids_dims=[], use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False,
                        vec_in_dim=None)


def host_kwargs(params_cls, **kw):
    """Constructor arguments for a model whose ``__init__`` builds ``params_cls(**kwargs)``, as
    this host's dataclass wants them: fields it does not have are dropped, required fields it
    added are filled with the classic models' values. Fails loudly on a required field nobody
    knows (so a new host release shows up here, not as a confusing TypeError)."""
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    out = {k: v for k, v in kw.items() if k in fields}
    for name, f in fields.items():
        if name in out or f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        if name not in CLASSIC_DEFAULTS:
            raise AssertionError(f"{params_cls.__name__} needs {name!r}: add its classic value to CLASSIC_DEFAULTS")
        out[name] = CLASSIC_DEFAULTS[name]
    return out


def engine_budget(us, activation_bytes: int) -> int:
    """About 40% of the weights, raised to 2.5x the largest unit where that is more (two
    streaming slots and room to spare), plus the measured activation reserve and a margin."""
    total = us.weight_bytes
    biggest = max(u.weight_bytes for u in us.units)
    return max(int(total * 0.4), int(biggest * 2.5)) + activation_bytes + MARGIN


@dataclasses.dataclass
class EngineRun:
    ref: torch.Tensor
    probe: torch.Tensor
    out: torch.Tensor
    again: torch.Tensor
    engine: object
    budget: int
    total: int
    probe_engine: object = None  # the engine of the unlimited-budget run (its dry run and measurements)


def run_engine(core, module: torch.nn.Module, call: Callable[[], tuple[tuple, dict]]) -> EngineRun:
    """The plain forward, then the same forward through ``Engine``: once at an unlimited budget
    (measures the activations, everything resident), then at the cutting budget (measured
    forward, then the planned forward). ``call()`` gives fresh inputs each time (ComfyUI's
    forwards write into ``transformer_options``)."""
    with torch.no_grad():
        args, kw = call()
        ref = module(*args, **kw)
        probe_eng = core.Engine(module, core.EngineConfig(budget_bytes=1 << 40, device="cpu"))
        args, kw = call()
        probe = probe_eng.run(module, *args, **kw)
        act = probe_eng.last_plan.activation_reserve_bytes
        us = probe_eng.unitset
        budget = engine_budget(us, act)
        eng = core.Engine(module, core.EngineConfig(budget_bytes=budget, device="cpu"))
        args, kw = call()
        out = eng.run(module, *args, **kw)
        args, kw = call()
        again = eng.run(module, *args, **kw)
    return EngineRun(ref, probe, out, again, eng, budget, us.weight_bytes, probe_eng)


# ---------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Case:
    id: str
    build: Callable[[], torch.nn.Module]
    family: str
    block_names: Callable[[torch.nn.Module], list[str]]
    prelude: bool = True
    final: bool = True
    inputs: Callable[[torch.nn.Module], tuple[tuple, dict]] | None = None  # fresh (args, kwargs)
    warning: bool = False  # the generic fallback warns
    cuts: bool = True  # the budget (>= 2.5x the largest unit) is below the weights: something streams


def _unet():
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    # SDXL-style (linear transformer, "sequential" ADM label embedding), shrunk: 2 levels, one
    # res block each, transformer depth 1 everywhere; GroupNorm(32) needs channels % 32 == 0.
    return UNetModel(image_size=32, in_channels=4, model_channels=32, out_channels=4, num_res_blocks=1,
                     channel_mult=(1, 2), num_heads=2, use_spatial_transformer=True,
                     transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                     transformer_depth_middle=1, context_dim=32, use_linear_in_transformer=True,
                     num_classes="sequential", adm_in_channels=16, legacy=False, **F32)


def _unet_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 4, 8, 8), torch.tensor([500.0]), rand(g, 1, 6, 32)), \
        dict(y=rand(g, 1, 16), transformer_options={})


def _unet_blocks(m):
    return blocks("input_blocks", len(m.input_blocks)) + ["middle_block"] + \
        blocks("output_blocks", len(m.output_blocks))


def _mmdit():
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT
    cfg = tm.tiny_sd3_config(depth=2)  # what model_detection infers for the tiny SD3 weights
    cfg["num_blocks"] = 5  # hidden 64*depth = 128, 2 heads; 5 joint blocks (the last pre_only)
    return MMDiT(**cfg, **F32)


def _mmdit_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 16, 8, 8), torch.tensor([0.5])), \
        dict(context=rand(g, 1, 6, 32), y=rand(g, 1, 32), transformer_options={})


FLUX_KW = dict(in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, hidden_size=64,
               mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=4, axes_dim=[8, 12, 12],
               theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)


def _flux():
    from comfy.ldm.flux.model import Flux, FluxParams
    return Flux(**host_kwargs(FluxParams, **FLUX_KW), **F32)


def _flux_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 4, 8, 8), torch.tensor([0.5]), rand(g, 1, 6, 32)), \
        dict(y=rand(g, 1, 16), guidance=torch.tensor([3.5]), transformer_options={})


def _flux_blocks(m):
    return blocks("double_blocks", len(m.double_blocks)) + blocks("single_blocks", len(m.single_blocks))


def _flux_manual_cast():
    from comfy.ldm.flux.model import Flux, FluxParams
    # the operations ComfyUI uses when the weight dtype is not the compute dtype (weights are
    # cast per call through comfy.ops.cast_bias_weight)
    return Flux(**host_kwargs(FluxParams, **FLUX_KW), dtype=torch.float32, device="cpu", operations=comfy.ops.manual_cast)


def _chroma():
    from comfy.ldm.chroma.model import Chroma, ChromaParams
    # img_in takes the patchified channels (x channels * 2 * 2); the approximator's input is
    # fixed by the forward (16 + 16 + 32 = 64) and its output is one modulation vector.
    return Chroma(**host_kwargs(
        ChromaParams, in_channels=16, out_channels=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
        num_heads=2, depth=2, depth_single_blocks=4, axes_dim=[8, 12, 12], theta=10000,
        patch_size=2, qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=32, n_layers=2), **F32)


def _chroma_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 4, 8, 8), torch.tensor([0.5]), rand(g, 1, 6, 32), torch.tensor([0.0])), \
        dict(transformer_options={})


def _hunyuan_video():
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
    return HunyuanVideo(**host_kwargs(
        HunyuanVideoParams, in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, hidden_size=64,
        mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=4, axes_dim=[8, 12, 12],
        theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True, byt5=False,
        meanflow=False), **F32)


def _hunyuan_video_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 4, 1, 8, 8), torch.tensor([0.5]), rand(g, 1, 6, 32)), \
        dict(y=rand(g, 1, 16), guidance=torch.tensor([3.5]), transformer_options={})


WAN_KW = dict(patch_size=(1, 2, 2), in_dim=4, dim=64, ffn_dim=128, freq_dim=256, text_dim=32, out_dim=4,
              num_heads=2, num_layers=4)


def _wan():
    from comfy.ldm.wan.model import WanModel
    return WanModel(model_type="t2v", **WAN_KW, **F32)


def _wan_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 4, 1, 8, 8), torch.tensor([0.5]), rand(g, 1, 6, 32)), dict(transformer_options={})


def _wan_i2v():
    from comfy.ldm.wan.model import WanModel
    # i2v: cross-attention also reads the CLIP-vision tokens, projected by img_emb (1280 -> dim)
    return WanModel(model_type="i2v", **WAN_KW, **F32)


def _wan_i2v_inputs(m):
    g = torch.Generator().manual_seed(1)
    args, kw = _wan_inputs(m)
    kw.update(clip_fea=rand(g, 1, 4, 1280))
    return args, kw


def _wan_vace():
    from comfy.ldm.wan.model import VaceWanModel
    # 4 main blocks, 2 VACE blocks (run after main blocks 0 and 2)
    return VaceWanModel(**WAN_KW, vace_layers=2, vace_in_dim=8, **F32)


def _wan_vace_inputs(m):
    g = torch.Generator().manual_seed(1)
    args, kw = _wan_inputs(m)
    # vace_context: (batch, n_vace, vace_in_dim, t, h, w), one strength per VACE input
    kw.update(vace_context=rand(g, 1, 1, 8, 1, 8, 8), vace_strength=[1.0])
    return args, kw


def _qwen_image():
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=4,
                                       attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                       pooled_projection_dim=32, axes_dims_rope=(8, 12, 12), **F32)


def _qwen_image_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 4, 1, 8, 8), torch.tensor([0.5]), rand(g, 1, 6, 32)), dict(transformer_options={})


def _lumina2():
    from comfy.ldm.lumina.model import NextDiT
    return NextDiT(patch_size=2, in_channels=4, dim=64, n_layers=4, n_refiner_layers=2, n_heads=2, n_kv_heads=1,
                   multiple_of=16, qk_norm=True, cap_feat_dim=32, axes_dims=[8, 12, 12],
                   axes_lens=[300, 512, 512], **F32)


def _lumina2_inputs(m):
    g = torch.Generator().manual_seed(1)
    # (x, timesteps, context = caption features, num_tokens)
    return (rand(g, 1, 4, 8, 8), torch.tensor([0.5]), rand(g, 1, 6, 32), 6), dict(transformer_options={})


def _lumina2_blocks(m):
    return blocks("noise_refiner", len(m.noise_refiner)) + blocks("context_refiner", len(m.context_refiner)) + \
        blocks("layers", len(m.layers))


def _hidream():
    from comfy.ldm.hidream.model import HiDreamImageTransformer2DModel
    return HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                          num_single_layers=4, attention_head_dim=32, num_attention_heads=2,
                                          caption_channels=[32, 32], text_emb_dim=16, num_routed_experts=4,
                                          num_activated_experts=2, axes_dims_rope=(8, 12, 12),
                                          max_resolution=(16, 16), llama_layers=list(range(6)), **F32)


def _hidream_inputs(m):
    g = torch.Generator().manual_seed(1)
    # y: pooled (text_emb_dim); context: T5 tokens; llama3: (batch, len(llama_layers), tokens, ch),
    # one Llama layer output per entry of llama_layers (each with its own caption_projection)
    return (rand(g, 1, 4, 8, 8), torch.tensor([0.5])), \
        dict(y=rand(g, 1, 16), context=rand(g, 1, 6, 32), encoder_hidden_states_llama3=rand(g, 1, 6, 6, 32),
             transformer_options={})


def _hidream_blocks(m):
    return blocks("double_stream_blocks", len(m.double_stream_blocks)) + \
        blocks("single_stream_blocks", len(m.single_stream_blocks))


def _pixart():
    from comfy.ldm.pixart.pixartms import PixArtMS
    return PixArtMS(input_size=8, patch_size=4, in_channels=4, hidden_size=64, depth=4, num_heads=2,
                    caption_channels=32, model_max_length=6, micro_condition=False, pe_interpolation=1.0, **F32)


def _pixart_inputs(m):
    g = torch.Generator().manual_seed(1)
    return (rand(g, 1, 4, 40, 40), torch.tensor([500.0]), rand(g, 1, 6, 32)), {}


CASES = [
    Case("sd_unet", _unet, "unet", _unet_blocks, inputs=_unet_inputs),
    Case("sd3_mmdit", _mmdit, "mmdit", lambda m: blocks("joint_blocks", len(m.joint_blocks)), inputs=_mmdit_inputs),
    Case("flux", _flux, "flux", _flux_blocks, inputs=_flux_inputs),
    Case("flux_manual_cast", _flux_manual_cast, "flux", _flux_blocks, inputs=_flux_inputs),
    Case("chroma", _chroma, "flux", _flux_blocks, inputs=_chroma_inputs),
    Case("hunyuan_video", _hunyuan_video, "flux", _flux_blocks, inputs=_hunyuan_video_inputs),
    Case("wan21", _wan, "wan", lambda m: blocks("blocks", len(m.blocks)), inputs=_wan_inputs),
    # img_emb's 1280-wide CLIP-vision projection is ~80% of this tiny model: 2.5x it is over the
    # weights, so everything stays resident (the segmented path runs, nothing streams)
    Case("wan21_i2v", _wan_i2v, "wan", lambda m: blocks("blocks", len(m.blocks)), inputs=_wan_i2v_inputs,
         cuts=False),
    Case("wan21_vace", _wan_vace, "wan",
         lambda m: blocks("blocks", len(m.blocks)) + blocks("vace_blocks", len(m.vace_blocks)),
         inputs=_wan_vace_inputs),
    Case("qwen_image", _qwen_image, "qwen_image", lambda m: blocks("transformer_blocks", len(m.transformer_blocks)),
         inputs=_qwen_image_inputs),
    Case("lumina2", _lumina2, "lumina2", _lumina2_blocks, inputs=_lumina2_inputs),
    Case("hidream", _hidream, "hidream", _hidream_blocks, inputs=_hidream_inputs),
    Case("pixart_generic", _pixart, "generic", lambda m: blocks("blocks", len(m.blocks)), inputs=_pixart_inputs,
         warning=True),
]

_BUILT: dict[str, torch.nn.Module] = {}


def built(case: Case) -> torch.nn.Module:
    if case.id not in _BUILT:
        torch.manual_seed(0)
        _BUILT[case.id] = seeded(case.build())
    return _BUILT[case.id]


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_units(pack, case):
    m = built(case)
    us = pack.vramcut_core.find_units(m)
    assert us.family == case.family, (us.family, us.warnings)
    if case.warning:
        assert us.warnings and "no known family" in us.warnings[0], us.warnings
    else:
        assert us.warnings == []
    names = [u.name for u in us.units if u.kind == "block"]
    assert names == case.block_names(m)
    kinds = [u.kind for u in us.units]
    assert ("prelude" in kinds) == case.prelude, kinds
    assert ("final" in kinds) == case.final, kinds
    # structural order: (shared,) prelude, the blocks, final
    order = [k for k in kinds if k != "shared"]
    if case.prelude:
        assert order[0] == "prelude"
    if case.final:
        assert order[-1] == "final"
    assert_partition(m, us)


_RUNS: dict[str, EngineRun] = {}


def engine_run(pack, case: Case) -> EngineRun:
    if case.id not in _RUNS:
        m = built(case)
        _RUNS[case.id] = run_engine(pack.vramcut_core, m, lambda: case.inputs(m))
    return _RUNS[case.id]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_engine_forward_bit_identical(pack, case):
    r = engine_run(pack, case)
    assert torch.equal(r.probe, r.ref)
    assert torch.equal(r.out, r.ref)
    assert torch.equal(r.again, r.ref)
    plan = r.engine.last_plan
    assert plan is not None and plan.measured
    assert plan.peak_bytes <= r.budget
    assert_peak_within_budget(r.engine.stats, r.budget)
    if case.cuts:
        assert plan.streamed_bytes_per_forward > 0, "everything resident: the budget did not cut"
        assert plan.resident_bytes < r.total


# Embedders that ComfyUI registers after the blocks although the forward runs them first. Each
# module registered after the blocks is a unit of its own, so these are entered once and the
# measured order (which the plan follows) puts them before the first block.
RUN_BEFORE_BLOCKS = {
    "wan21_vace": ["vace_patch_embedding"],
    "wan21_i2v": ["img_emb"],
    "lumina2": ["t_embedder", "cap_embedder"],
    "hidream": ["caption_projection"],
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_units_entered_once_in_execution_order(pack, case):
    """In the measured forward every unit is entered once, and the plan's order is the order
    the forward ran them in."""
    r = engine_run(pack, case)
    eng = r.engine
    meas = eng.measurements[eng.last_signature]
    kinds = {u.name: u.kind for u in eng.unitset.units}
    entered = [n for n in meas if n in kinds]
    twice = {n: meas[n].calls for n in entered if meas[n].calls != 1}
    assert not twice, f"units entered more than once: {twice} (order {entered})"
    first_block = min(i for i, n in enumerate(entered) if kinds[n] == "block")
    for name in RUN_BEFORE_BLOCKS.get(case.id, []):
        assert entered.index(name) < first_block, (name, entered)
    planned = [u.name for u in eng.last_plan.units][:len(entered)]
    assert planned == entered
