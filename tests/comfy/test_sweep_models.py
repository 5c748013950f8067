"""The sweep: every diffusion-model class the host registers, built small, cut, run bit-identical.

The host's list (``comfy.supported_models.models``) is read at run time, and each entry is mapped
to the diffusion module its ``get_model`` builds (``BaseModel.__init__``'s ``unet_model``, caught
before anything is allocated). A *recipe* per diffusion module builds it small with the host's
own class and operations: tiny widths and one or two blocks per list, plus the entry's own
``unet_config`` keys the recipe names as variant keys (a Flux without guidance, a Wan i2v), each
keyword kept only where the host's constructor (or its parameter dataclass) takes it.

For every entry with a recipe: ``find_units`` gives the expected family (the generic fallback
says so in a warning), every parameter and buffer is in exactly one unit, and the forward through
``Engine`` under a budget that streams equals the plain forward bit for bit. The dry run's
per-unit activation peaks (``trace``) are held against the CPU meter's of the same forward
(``unit_checks.trace_bound``); a diffusion module the dry run cannot run is listed in
:data:`UNTRACED` with the reason.

An entry without a recipe is listed in :data:`NOT_SWEPT` with the reason. The completeness test
fails when the host registers a class that is in neither (a new family cannot be missed), and
when the table names a class the host has but a recipe now covers. Classes that exist only on
some hosts are found by presence: the sweep runs what the host under test registers.

``python tests/comfy/test_sweep_models.py`` prints the sweep as a Markdown table (the coverage
table of ``docs/coverage.md``).
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from typing import Callable

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

import comfy.model_base  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.supported_models  # noqa: E402

import test_families as tf  # noqa: E402  (seeded weights, the engine run and its budget)

OPS = comfy.ops.disable_weight_init
DEV = dict(dtype=torch.float32, device="cpu", operations=OPS)


# ---------------------------------------------------------------------------------------------
# which diffusion module each registered class builds


class _Caught(Exception):
    pass


# Sizes the loader would have detected from the weights, which some registered classes read in
# ``__init__``/``get_model`` before they build anything (Flux.2's memory factor, SD2's channels).
_PROBE_CONFIG = dict(in_channels=4, hidden_size=64, model_channels=64, context_dim=64)


def diffusion_class(model_cls) -> type | None:
    """The diffusion module class ``model_cls.get_model`` builds, or None where its
    ``get_model`` needs weights to decide (it reads the state dict before building)."""
    caught = {}
    orig = comfy.model_base.BaseModel.__init__

    def catch(self, model_config, *args, unet_model=None, **kw):
        if unet_model is None:  # BaseModel's default
            unet_model = inspect.signature(orig).parameters["unet_model"].default
        caught["cls"] = unet_model
        raise _Caught

    comfy.model_base.BaseModel.__init__ = catch
    try:
        model_cls(dict(_PROBE_CONFIG, **model_cls.unet_config)).get_model({}, device="meta")
    except _Caught:
        return caught["cls"]
    except Exception:
        return None
    finally:
        comfy.model_base.BaseModel.__init__ = orig
    return None


def accepted(cls, kw: dict) -> dict:
    """``kw`` less the keys ``cls``'s constructor does not take. A constructor that passes
    ``**kwargs`` on to a parameter dataclass (Flux, HunyuanVideo, Chroma) takes that dataclass's
    fields."""
    params = inspect.signature(cls.__init__).parameters
    names = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        mod = sys.modules[cls.__module__]
        dcs = [v for k, v in vars(mod).items() if k.endswith("Params") and dataclasses.is_dataclass(v)]
        if not dcs:
            return dict(kw)
        for dc in dcs:
            names |= {f.name for f in dataclasses.fields(dc)}
    return {k: v for k, v in kw.items() if k in names}


# ---------------------------------------------------------------------------------------------
# recipes: one per diffusion module class


def _g():
    return torch.Generator().manual_seed(1)


def rand(*shape):
    return torch.randn(*shape, generator=_g())


@dataclasses.dataclass
class Recipe:
    cls: str  # "module.Class" of the diffusion module
    kw: dict  # tiny constructor keywords (filtered by what the host's constructor takes)
    inputs: Callable[[torch.nn.Module], tuple[tuple, dict]]
    family: str  # expected registry family ("generic": the fallback)
    variant_keys: tuple[str, ...] = ()  # keys of the registered class's unet_config used as-is
    label: str = ""  # the families users know it as
    adapt: Callable[[dict], dict] | None = None  # variant keys the tiny build cannot take as they are

    def kwargs(self, model_cls) -> tuple[type, dict]:
        """The host's class and the keywords the small build of ``model_cls`` passes it."""
        modname, _, clsname = self.cls.rpartition(".")
        cls = getattr(__import__(modname, fromlist=[clsname]), clsname)
        kw = dict(self.kw)
        kw.update({k: v for k, v in model_cls.unet_config.items() if k in self.variant_keys})
        if self.adapt is not None:
            kw = self.adapt(kw)
        return cls, accepted(cls, kw)

    def build(self, model_cls) -> torch.nn.Module:
        cls, kw = self.kwargs(model_cls)
        torch.manual_seed(0)
        return tf.seeded(cls(**kw, **DEV))


def _xtc(c=4, *spatial, tokens=6, ctx=32):
    return rand(1, c, *spatial), torch.tensor([0.5]), rand(1, tokens, ctx)


def _flux_inputs(m):
    p = m.params
    c = p.in_channels  # before patchifying (Chroma's counts after)
    kw = dict(transformer_options={})
    if p.vec_in_dim:
        kw["y"] = rand(1, p.vec_in_dim)
    if p.guidance_embed:
        kw["guidance"] = torch.tensor([3.5])
    return _xtc(c, 8, 8, ctx=p.context_in_dim), kw


def _chroma_inputs(m):
    p = m.params
    c = p.in_channels // (p.patch_size ** 2)
    return _xtc(c, 8, 8, ctx=p.context_in_dim) + (torch.tensor([0.0]),), dict(transformer_options={})


def _chroma_radiance_inputs(m):
    p = m.params
    return _xtc(p.in_channels, 16, 16, ctx=p.context_in_dim) + (torch.tensor([0.0]),), dict(transformer_options={})


def _hunyuan_video_inputs(m):
    p = m.params
    kw = dict(transformer_options={})
    if p.vec_in_dim:
        kw["y"] = rand(1, p.vec_in_dim)
    if p.guidance_embed:
        kw["guidance"] = torch.tensor([3.5])
    if getattr(p, "vision_in_dim", None):
        kw["clip_fea"] = rand(1, 4, p.vision_in_dim)
    return _xtc(p.in_channels, 1, 8, 8, ctx=p.context_in_dim), kw


def _wan_inputs(m):
    kw = dict(transformer_options={})
    if getattr(m, "img_emb", None) is not None:
        kw["clip_fea"] = rand(1, 4, 1280)
    return _xtc(m.patch_embedding.in_channels, 1, 8, 8, ctx=32), kw


def _vace_inputs(m):
    args, kw = _wan_inputs(m)
    kw.update(vace_context=rand(1, 1, m.vace_patch_embedding.in_channels, 1, 8, 8), vace_strength=[1.0])
    return args, kw


def _qwen_image_inputs(m):
    return _xtc(m.in_channels // 4, 1, 8, 8, ctx=32), dict(transformer_options={})  # in_channels: patchified


def _nextdit_inputs(m):
    return _xtc(m.in_channels, 8, 8, ctx=32) + (6,), dict(transformer_options={})


def _unet_inputs(m):
    kw = dict(transformer_options={})
    if m.num_classes is not None:
        kw["y"] = rand(1, 16)
    return _xtc(m.in_channels, 8, 8, ctx=32), kw


def _mmdit_inputs(m):
    return (rand(1, 16, 8, 8), torch.tensor([0.5])), dict(context=rand(1, 6, 32), y=rand(1, 32),
                                                          transformer_options={})


def _hidream_inputs(m):
    return (rand(1, 4, 8, 8), torch.tensor([0.5])), \
        dict(y=rand(1, 16), context=rand(1, 6, 32), encoder_hidden_states_llama3=rand(1, len(m.llama_layers), 6, 32),
             transformer_options={})


def _pixart_inputs(m):
    return (rand(1, 4, 40, 40), torch.tensor([500.0]), rand(1, 6, 32)), {}


def _kandinsky5_inputs(m):
    return _xtc(m.visual_embed_dim // 4, 1, 8, 8, ctx=32) + (rand(1, 16),), dict(transformer_options={})


def _omnigen2_inputs(m):
    return _xtc(4, 8, 8, ctx=32) + (6,), dict(transformer_options={})


def _ltxv_inputs(m):
    return _xtc(m.patchify_proj.in_features, 2, 4, 4, ctx=32) + (None,), dict(transformer_options={})


def _ltxav_inputs(m):
    (x, t, _, mask), kw = _ltxv_inputs(m)
    audio = rand(1, m.num_audio_channels, 4, m.audio_frequency_bins)
    # the prompt: video then audio caption channels, side by side
    return ([x, audio], t, rand(1, 6, 2 * m.caption_channels), mask), kw


def _cosmos2_inputs(m):
    return _xtc(16, 1, 8, 8, ctx=32), dict(transformer_options={})


def _wan_adapt(kw):
    # WanModel itself builds t2v or i2v; the other model types are for the subclasses or change
    # only the conditioning (Flow-RVS)
    return kw if kw["model_type"] in ("t2v", "i2v") else dict(kw, model_type="t2v")


FLUX = dict(in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
            num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=10000, patch_size=2,
            qkv_bias=True, guidance_embed=True, txt_ids_dims=[])
HUNYUAN = dict(in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
               num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=256, patch_size=[1, 2, 2],
               qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False, use_cond_type_embedding=False,
               vision_in_dim=None, meanflow_sum=False)
WAN = dict(patch_size=(1, 2, 2), in_dim=4, dim=64, ffn_dim=128, freq_dim=256, text_dim=32, out_dim=4, num_heads=2,
           num_layers=2)

RECIPES = [
    Recipe("comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel",
           dict(image_size=32, in_channels=4, model_channels=32, out_channels=4, num_res_blocks=1,
                channel_mult=(1, 2), num_heads=2, use_spatial_transformer=True, transformer_depth=[1, 1],
                transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1, context_dim=32,
                use_linear_in_transformer=True, num_classes="sequential", adm_in_channels=16, legacy=False),
           _unet_inputs, "unet", ("in_channels",), "SD1.x / SD2 / SDXL UNet"),
    Recipe("comfy.ldm.modules.diffusionmodules.mmdit.OpenAISignatureMMDITWrapper",
           dict(tm.tiny_sd3_config(depth=2), num_blocks=3), _mmdit_inputs, "mmdit", (), "SD3 / SD3.5"),
    Recipe("comfy.ldm.flux.model.Flux", FLUX, _flux_inputs, "flux", ("guidance_embed", "in_channels"),
           "Flux.1 / Flux.2 / LongCat"),
    Recipe("comfy.ldm.chroma.model.Chroma",
           dict(FLUX, in_channels=16, in_dim=64, out_dim=64, hidden_dim=32, n_layers=2), _chroma_inputs, "flux",
           (), "Chroma"),
    Recipe("comfy.ldm.chroma_radiance.model.ChromaRadiance",
           dict(FLUX, in_channels=3, out_channels=3, patch_size=4, in_dim=64, out_dim=64, hidden_dim=32, n_layers=2,
                nerf_hidden_size=16, nerf_mlp_ratio=2, nerf_depth=2, nerf_max_freqs=4, nerf_tile_size=0,
                nerf_final_head_type="conv", nerf_embedder_dtype=None, use_x0=False, use_sequential_txt_ids=False),
           _chroma_radiance_inputs, "chroma_radiance", (), "Chroma Radiance"),
    Recipe("comfy.ldm.hunyuan_video.model.HunyuanVideo", HUNYUAN, _hunyuan_video_inputs, "flux",
           ("guidance_embed",), "HunyuanVideo 1.0 / 1.5, HunyuanImage 2.1"),
    Recipe("comfy.ldm.wan.model.WanModel", dict(WAN, model_type="t2v"), _wan_inputs, "wan",
           ("model_type", "in_dim", "out_dim"), "Wan 2.1 / 2.2 (each expert)", adapt=_wan_adapt),
    Recipe("comfy.ldm.wan.model.VaceWanModel", dict(WAN, vace_layers=1, vace_in_dim=8), _vace_inputs, "wan", (),
           "Wan VACE"),
    Recipe("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",
           dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(8, 12, 12)),
           _qwen_image_inputs, "qwen_image", (), "Qwen-Image (+edit)"),
    Recipe("comfy.ldm.lumina.model.NextDiT",
           dict(patch_size=2, in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=1,
                multiple_of=16, qk_norm=True, cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[300, 512, 512]),
           _nextdit_inputs, "lumina2", ("z_image_modulation", "pad_tokens_multiple"), "Lumina2 / Z-Image"),
    Recipe("comfy.ldm.hidream.model.HiDreamImageTransformer2DModel",
           dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=32,
                num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=16, num_routed_experts=4,
                num_activated_experts=2, axes_dims_rope=(8, 12, 12), max_resolution=(16, 16),
                llama_layers=list(range(3))),
           _hidream_inputs, "hidream", (), "HiDream"),
    Recipe("comfy.ldm.pixart.pixartms.PixArtMS",
           dict(input_size=8, patch_size=4, in_channels=4, hidden_size=64, depth=4, num_heads=2,
                caption_channels=32, model_max_length=6, micro_condition=False, pe_interpolation=1.0),
           _pixart_inputs, "generic", (), "PixArt"),
    Recipe("comfy.ldm.kandinsky5.model.Kandinsky5",
           dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=16, time_dim=32, model_dim=64,
                ff_dim=128, visual_embed_dim=4 * 4, patch_size=(1, 2, 2), num_text_blocks=1,
                num_visual_blocks=2, axes_dims=(8, 12, 12)),
           _kandinsky5_inputs, "kandinsky5", (), "Kandinsky 5"),
    Recipe("comfy.ldm.omnigen.omnigen2.OmniGen2Transformer2DModel",
           dict(patch_size=2, in_channels=4, hidden_size=64, num_layers=2, num_refiner_layers=1,
                num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(8, 12, 12), text_feat_dim=32),
           _omnigen2_inputs, "omnigen2", (), "OmniGen2"),
    Recipe("comfy.ldm.lightricks.model.LTXVModel",
           dict(in_channels=8, cross_attention_dim=64, attention_head_dim=32, num_attention_heads=2,
                caption_channels=32, num_layers=2),
           _ltxv_inputs, "ltxv", (), "LTX-Video"),
    Recipe("comfy.ldm.lightricks.av_model.LTXAVModel",
           dict(in_channels=8, audio_in_channels=128,  # 8 audio channels x 16 bins, fixed by the host
                cross_attention_dim=64, audio_cross_attention_dim=32,
                attention_head_dim=32, audio_attention_head_dim=16, num_attention_heads=2,
                audio_num_attention_heads=2, caption_channels=32, num_layers=2),
           _ltxav_inputs, "ltxv", (), "LTX-2 (audio + video)"),
    Recipe("comfy.ldm.cosmos.predict2.MiniTrainDIT",
           dict(max_img_h=16, max_img_w=16, max_frames=4, in_channels=16, out_channels=16, patch_spatial=2,
                patch_temporal=1, model_channels=64, num_blocks=2, num_heads=2, crossattn_emb_channels=32,
                pos_emb_cls="rope3d"),
           _cosmos2_inputs, "cosmos", (), "Cosmos Predict2"),
]
RECIPE_BY_CLASS = {r.cls: r for r in RECIPES}


def _qual(cls) -> str:
    return f"{cls.__module__}.{cls.__name__}"


# The registered classes the sweep does not build, with the reason. Keep the reason honest:
# "needs weights" (get_model reads the state dict to decide what to build), "no small recipe yet"
# (buildable in principle; nobody has written the tiny config and inputs), or why CPU cannot.
NOT_SWEPT: dict[str, str] = {}
_NO_RECIPE = "no small recipe yet (diffusion module {cls}): the registry/fallback still applies, parity untested"


# Diffusion modules whose forward the dry run cannot run (the engine measures their first forward
# instead), with the reason; the test fails when one of them traces or another one stops tracing.
UNTRACED: dict[str, str] = {
    "comfy.ldm.hidream.model.HiDreamImageTransformer2DModel":
        "the MoE router picks each expert's tokens by value (aten.nonzero: shapes depend on the data)",
}


# ---------------------------------------------------------------------------------------------
# the sweep, computed once per host


@dataclasses.dataclass
class Entry:
    name: str  # the registered class
    dcls: type | None
    recipe: Recipe | None
    reason: str = ""


def sweep() -> list[Entry]:
    out = []
    for model_cls in comfy.supported_models.models:
        dcls = diffusion_class(model_cls)
        recipe = RECIPE_BY_CLASS.get(_qual(dcls)) if dcls is not None else None
        if dcls is None:
            reason = "get_model reads the weights to decide what to build (needs a state dict)"
        elif recipe is None:
            reason = _NO_RECIPE.format(cls=_qual(dcls))
        else:
            reason = ""
        out.append(Entry(model_cls.__name__, dcls, recipe, reason))
    return out


ENTRIES = sweep()
SWEPT = [e for e in ENTRIES if e.recipe is not None]
_MODEL_CLS = {m.__name__: m for m in comfy.supported_models.models}


def test_every_registered_class_is_swept_or_listed():
    """Each class of the host's list is built by a recipe or listed with its reason; the list
    names no class a recipe now builds."""
    for e in ENTRIES:
        assert (e.recipe is not None) != bool(e.reason), e
    assert len(ENTRIES) == len(comfy.supported_models.models)
    assert SWEPT, "no registered class was built"


_BUILT: dict[str, torch.nn.Module] = {}


def build_key(e: Entry) -> str:
    """Registered classes whose small builds are the same (SD1.5 and SDXL differ only in sizes
    the small build sets) share one build and one parity run."""
    cls, kw = e.recipe.kwargs(_MODEL_CLS[e.name])
    return f"{_qual(cls)}{sorted(kw.items(), key=str)!r}"


def built(e: Entry) -> torch.nn.Module:
    key = build_key(e)
    if key not in _BUILT:
        _BUILT.clear()  # one model alive at a time: the sweep stays small in memory
        _BUILT[key] = e.recipe.build(_MODEL_CLS[e.name])
    return _BUILT[key]


_RUNS: dict[str, "tf.EngineRun"] = {}


def streamed_run(core, e: Entry) -> "tf.EngineRun":
    key = build_key(e)
    if key not in _RUNS:
        m = built(e)
        _RUNS[key] = run_streamed(core, m, lambda: e.recipe.inputs(m))
    return _RUNS[key]


@pytest.mark.parametrize("e", SWEPT, ids=[e.name for e in SWEPT])
def test_sweep_units_and_parity(pack, e):
    core = pack.vramcut_core
    m = built(e)
    assert type(m) is e.dcls
    us = core.find_units(m)
    assert us.family == e.recipe.family, (us.family, us.warnings)
    assert bool(us.warnings) == (us.family == "generic"), us.warnings
    assert sum(u.kind == "block" for u in us.units) >= 2
    assert_partition(m, us)
    r = streamed_run(core, e)
    for got in (r.probe, r.out, r.again):
        assert _same(got, r.ref)
    plan = r.engine.last_plan
    assert plan.measured and plan.peak_bytes <= r.budget
    assert plan.streamed_bytes_per_forward > 0, "everything resident: the budget did not cut"


@pytest.mark.parametrize("e", SWEPT, ids=[e.name for e in SWEPT])
def test_sweep_trace_matches_measured(pack, e):
    """The dry run's per-unit activation peaks against the CPU meter's of the first real forward
    (the run the parity test made: no forward of its own when run after it)."""
    assert_trace_bound(streamed_run(pack.vramcut_core, e).probe_engine, e.name, _qual(e.dcls) in UNTRACED)


def run_streamed(core, module, call) -> "tf.EngineRun":
    """``test_families.run_engine`` with the budget held below the weights: where one unit is
    most of a tiny model (a fixed 1280-wide CLIP-vision projection beside 64-wide blocks), the
    planner keeps it resident and streams the blocks."""
    with torch.no_grad():
        args, kw = call()
        ref = module(*args, **kw)
        probe_eng = core.Engine(module, core.EngineConfig(budget_bytes=1 << 40, device="cpu"))
        args, kw = call()
        probe = probe_eng.run(module, *args, **kw)
        act = probe_eng.last_plan.activation_reserve_bytes
        us = probe_eng.unitset
        budget = min(tf.engine_budget(us, act), us.weight_bytes + act - 1)
        eng = core.Engine(module, core.EngineConfig(budget_bytes=budget, device="cpu"))
        args, kw = call()
        out = eng.run(module, *args, **kw)
        args, kw = call()
        again = eng.run(module, *args, **kw)
    return tf.EngineRun(ref, probe, out, again, eng, budget, us.weight_bytes, probe_eng)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------------------------
# the coverage table


def coverage_rows(core) -> list[tuple[str, ...]]:
    """(registered class, diffusion module, how it is cut, units, parity, traced/measured
    activation peaks) for every class of the host's list; parity is run here, as the test runs it."""
    rows = []
    for e in ENTRIES:
        dname = e.dcls.__name__ if e.dcls is not None else "?"
        if e.recipe is None:
            rows.append((e.name, dname, "not swept", "", e.reason, ""))
            continue
        m = built(e)
        us = core.find_units(m)
        how = f"registry: {us.label}" if us.family != "generic" else "generic fallback (warns on the node)"
        blocks = [u.name for u in us.units if u.kind == "block"]
        lists = dict.fromkeys(b.rsplit(".", 1)[0] if b.rsplit(".", 1)[-1].isdigit() else b for b in blocks)
        units = f"{len(us.units)} ({len(blocks)} blocks in {', '.join(f'`{q}`' for q in lists)})"
        trace = ""
        try:
            r = streamed_run(core, e)
            ok = all(_same(x, r.ref) for x in (r.probe, r.out, r.again))
            streamed = r.engine.last_plan.streamed_bytes_per_forward > 0
            parity = "bit-identical, streamed" if ok and streamed else ("bit-identical, not streamed" if ok else "DIFFERS")
            trace = trace_text(r.probe_engine)
        except Exception as exc:  # the table reports it; the test fails on it
            parity = f"error: {type(exc).__name__}"
        rows.append((e.name, dname, how, units, parity, trace))
    return rows


def main() -> None:
    import time

    import vramcut_core as core
    t0 = time.perf_counter()
    rows = coverage_rows(core)
    host = os.path.basename(os.path.dirname(tm.comfyui_path())) or tm.comfyui_path()
    swept = [r for r in rows if r[2] != "not swept"]
    reg = sum(r[2].startswith("registry") for r in swept)
    print(f"### Host {host}\n")
    print(f"{len(rows)} registered classes: {len(swept)} swept ({reg} cut by the registry, "
          f"{len(swept) - reg} by the generic fallback), {len(rows) - len(swept)} not swept. "
          f"Small builds on CPU; {time.perf_counter() - t0:.0f} s for the table.\n")
    print("| class | diffusion module | cut by | units (small build) | parity | traced / measured activation "
          "peak per unit (min–max) |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
