"""Tiny *real* models built through ComfyUI's own loaders, for CPU tests (seeded, fast).

Every builder makes random-but-seeded weights with the exact key names and shapes that
ComfyUI's loaders expect, then hands them to the loader ComfyUI itself uses for real files:

* diffusion models: ``comfy.sd.load_diffusion_model_state_dict`` (config inferred from the
  weights by ``comfy.model_detection``), giving a ``comfy.model_patcher.ModelPatcher``;
* text encoders: ``comfy.sd.load_text_encoder_state_dicts`` with a small config passed
  through ``model_options`` (``"model_config"`` for CLIP-L, ``"t5base_model_config"`` for T5;
  read by ``comfy.sd1_clip.SDClipModel``), giving a ``comfy.sd.CLIP``;
* VAE: ``comfy.sd.VAE(sd=..., config=...)``;
* LoRA: a ComfyUI-format LoRA dict for ``comfy.sd.load_lora_for_models``;
* upscaler: ``spandrel.ModelLoader().load_from_state_dict`` (what ``UpscaleModelLoader`` does);
* CLIP vision: ``comfy.clip_vision.ClipVisionModel`` with a small JSON config.

This module holds no tests and imports nothing from ComfyUI at import time. :func:`import_comfy`
(called by every builder, and by tests before they import ``comfy``) puts ComfyUI on
``sys.path`` and sets ``args.cpu = True`` before ``comfy.model_management`` is imported.
ComfyUI is found through ``$COMFYUI_PATH``, falling back to ``~/comfy/ComfyUI``
(:func:`comfyui_path`); when neither exists :func:`import_comfy` raises
:class:`ComfyUINotFound` (tests turn that into a skip).

Weights are drawn from ``torch.Generator().manual_seed(seed)`` in state-dict order, so the same
seed gives bit-identical models. The weights are random: outputs are finite and have the right
shapes, but they mean nothing.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

DEFAULT_COMFYUI_PATH = "~/comfy/ComfyUI"

StateDict = Dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------
# ComfyUI location and import
# --------------------------------------------------------------------------------------------

class ComfyUINotFound(ImportError):
    """ComfyUI could not be found (neither ``$COMFYUI_PATH`` nor ``~/comfy/ComfyUI``)."""


def _is_comfyui(path: Optional[str]) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "comfy", "model_management.py"))


def comfyui_path() -> Optional[str]:
    """The ComfyUI checkout to test against: ``$COMFYUI_PATH`` when it is set (``None`` if it
    holds no ComfyUI: a path given on purpose is not second-guessed), else comfy-cli's default
    ``~/comfy/ComfyUI`` if that holds ComfyUI, else ``None``."""
    given = os.environ.get("COMFYUI_PATH")
    cand = os.path.abspath(os.path.expanduser(given or DEFAULT_COMFYUI_PATH))
    return cand if _is_comfyui(cand) else None


def import_comfy() -> str:
    """Make ``import comfy...`` work on CPU; idempotent. Returns the ComfyUI path.

    Inserts the ComfyUI root at the front of ``sys.path`` (once) and sets
    ``comfy.cli_args.args.cpu = True`` before ``comfy.model_management`` is imported, then
    imports ``comfy.model_management`` so the device is fixed to CPU.
    Raises :class:`ComfyUINotFound` when there is no ComfyUI checkout.
    """
    path = comfyui_path()
    if path is None:
        raise ComfyUINotFound(
            "ComfyUI not found: set COMFYUI_PATH to a ComfyUI checkout "
            f"(looked at $COMFYUI_PATH={os.environ.get('COMFYUI_PATH')!r} and {DEFAULT_COMFYUI_PATH})")
    if path not in sys.path:
        sys.path.insert(0, path)
    # ``comfy`` is a namespace package (no __init__.py); a stale namespace module bound to other
    # directories (e.g. a tests/comfy folder seen before ComfyUI was on sys.path) must not win.
    mod = sys.modules.get("comfy")
    if mod is not None:
        mpath = [os.path.abspath(p) for p in getattr(mod, "__path__", [])]
        if os.path.join(path, "comfy") not in mpath:
            for name in [n for n in sys.modules if n == "comfy" or n.startswith("comfy.")]:
                del sys.modules[name]
    try:
        from comfy.cli_args import args
        if "comfy.model_management" not in sys.modules:
            args.cpu = True
        elif not args.cpu:
            args.cpu = True  # too late to change the chosen device; on a CPU-only host it is CPU anyway
        import comfy.model_management  # noqa: F401  (fixes the device now, on CPU)
        import comfy.sd  # noqa: F401  (pulls in the rest of what the tests use: torchaudio on newer hosts)
    except ModuleNotFoundError as e:
        raise ComfyUINotFound(
            f"ComfyUI at {path} cannot be imported here: its requirements are not installed in this "
            f"environment ({e}). Install them with: python -m pip install -r {path}/requirements.txt "
            "requests (newer hosts also need: python -m pip install --no-deps torchaudio)") from e
    return path


def comfy_import_problem() -> Optional[str]:
    """Why :func:`import_comfy` fails in a fresh interpreter (the skip reason every ComfyUI test
    gives), or ``None`` when the host imports. For tests that run the host in a subprocess and
    must tell "host not usable here" (a skip) from "host usable but not used" (a failure)."""
    import subprocess

    code = ("import tiny_models\n"
            "try:\n    tiny_models.import_comfy()\n"
            "except tiny_models.ComfyUINotFound as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)), timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"probing the ComfyUI import failed: {r.stderr[-2000:]}")
    return r.stdout.strip() or None


# --------------------------------------------------------------------------------------------
# Seeded weights
# --------------------------------------------------------------------------------------------

_NORM_HINTS = ("norm", "ln_", "layernorm", "layer_norm", ".scale", "gamma")


def seeded_state_dict(sd: StateDict, seed: int = 0, gain: float = 1.0) -> StateDict:
    """Fill a state dict's float tensors in place, deterministically, and return it.

    Matrices / convs / embeddings: N(0, 1) * gain / sqrt(fan_in); biases: N(0, 0.02);
    1-D norm scales: 1 + N(0, 0.02); other 1-D tensors: N(0, 0.02). Integer tensors untouched.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sd.items():
            if not t.dtype.is_floating_point:
                continue
            shape = tuple(t.shape)
            if t.ndim == 0:
                val = torch.randn((), generator=g) * 0.02
            elif name.endswith("bias"):
                val = torch.randn(shape, generator=g) * 0.02
            elif t.ndim == 1:
                if any(h in name.lower() for h in _NORM_HINTS) or name.endswith("weight"):
                    val = 1.0 + torch.randn(shape, generator=g) * 0.02
                else:
                    val = torch.randn(shape, generator=g) * 0.02
            else:
                fan_in = max(1, t.numel() // shape[0])
                val = torch.randn(shape, generator=g) * (gain / math.sqrt(fan_in))
            t.copy_(val.to(t.dtype))
    return sd


def _module_state_dict(module: torch.nn.Module, seed: int, gain: float = 1.0) -> StateDict:
    sd = {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}
    return seeded_state_dict(sd, seed, gain)


def _copy_sd(sd: StateDict) -> StateDict:
    """ComfyUI loaders pop keys from the dict they get; hand them a copy."""
    return {k: v.clone() for k, v in sd.items()}


def _ops():
    import comfy.ops
    return comfy.ops.disable_weight_init  # no init cost; we fill every tensor ourselves


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# SD1.5 (UNet)
# --------------------------------------------------------------------------------------------

def load_tiny_sd15_unet(seed: int = 0):
    """A ModelPatcher of an SD1.5-style UNet, built through the host's own model config
    (``supported_models.SD15``, ``BaseModel``) at a tiny size, its weights seeded; inputs: a
    latent (1, 4, 8, 8) and ``c_crossattn`` (1, tokens, 32)."""
    import_comfy()
    import comfy.model_patcher
    import comfy.supported_models

    unet = dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True, legacy=False,
                adm_in_channels=None, in_channels=4, model_channels=32, num_res_blocks=[1, 1],
                transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1], channel_mult=[1, 2],
                transformer_depth_middle=1, use_linear_in_transformer=False, context_dim=32,
                use_temporal_resblock=False, use_temporal_attention=False, dtype=torch.float32)
    cfg = comfy.supported_models.SD15(unet)
    cfg.set_inference_dtype(torch.float32, None)
    base = cfg.get_model({}, device=torch.device("cpu"))
    g = _gen(seed)
    with torch.no_grad():
        for p in base.diffusion_model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# SD3 (MMDiT)
# --------------------------------------------------------------------------------------------

SD3_LATENT_SHAPE = (1, 16, 8, 8)


def tiny_sd3_config(depth: int = 2, context_dim: int = 32, pooled_dim: int = 32,
                    pos_embed_max_size: int = 16) -> dict:
    """The MMDiT config ComfyUI's ``model_detection.detect_unet_config`` infers for
    :func:`tiny_sd3_state_dict` (hidden = 64 * depth, heads = depth, patch 2, 16 channels)."""
    hidden = 64 * depth
    return {
        "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": depth,
        "input_size": None, "adm_in_channels": pooled_dim,
        "context_embedder_config": {"target": "torch.nn.Linear",
                                    "params": {"in_features": context_dim, "out_features": hidden}},
        "num_patches": pos_embed_max_size * pos_embed_max_size,
        "pos_embed_max_size": pos_embed_max_size,
        "pos_embed_scaling_factor": None, "x_block_self_attn_layers": [],
    }


def tiny_sd3_state_dict(depth: int = 2, seed: int = 0, context_dim: int = 32, pooled_dim: int = 32,
                        pos_embed_max_size: int = 16) -> StateDict:
    """Raw SD3 MMDiT weights (keys as in a diffusion_models/*.safetensors, no prefix).

    depth 2 -> hidden 128, 2 heads, ~1.1M params (context_dim 32). ``context_dim`` is the text
    embedding width (real SD3: 4096; use 1024 to feed 1024-wide conditioning), ``pooled_dim`` the
    pooled-vector width (real SD3: 2048). ``pos_embed_max_size`` 16 allows latents up to 32x32.
    """
    import_comfy()
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT
    cfg = tiny_sd3_config(depth, context_dim, pooled_dim, pos_embed_max_size)
    m = MMDiT(**cfg, dtype=torch.float32, device="cpu", operations=_ops())
    return _module_state_dict(m, seed)


def load_tiny_sd3(depth: int = 2, seed: int = 0, context_dim: int = 32, pooled_dim: int = 32,
                  state_dict: Optional[StateDict] = None, return_state_dict: bool = False,
                  model_options: Optional[dict] = None):
    """ModelPatcher for a tiny SD3 through ``comfy.sd.load_diffusion_model_state_dict``
    (``comfy.model_base.SD3``, flow matching, shift 3). Sample with latents like
    ``SD3_LATENT_SHAPE`` and :func:`tiny_sd3_conditioning`. With ``return_state_dict`` returns
    ``(patcher, raw_state_dict)``.

    Note: ``comfy.model_base.SD3.encode_adm`` reads ``cond["pooled_output"]`` unconditionally, so
    LotusConditioning-style ``[[tensor(1, 77, 1024), {}]]`` (no pooled) raises KeyError on SD3;
    with ``context_dim=1024`` such a tensor works once a ``pooled_output`` is added.
    """
    import_comfy()
    import comfy.sd
    sd = state_dict if state_dict is not None else tiny_sd3_state_dict(depth, seed, context_dim, pooled_dim)
    patcher = comfy.sd.load_diffusion_model_state_dict(_copy_sd(sd), model_options=model_options or {})
    if patcher is None:
        raise RuntimeError("ComfyUI did not recognise the tiny SD3 state dict")
    return (patcher, sd) if return_state_dict else patcher


def tiny_sd3_conditioning(seed: int = 0, context_dim: int = 32, pooled_dim: int = 32, tokens: int = 8,
                          batch: int = 1) -> Tuple[list, list]:
    """(positive, negative) ComfyUI CONDITIONING for :func:`load_tiny_sd3`:
    ``[[tensor(batch, tokens, context_dim), {"pooled_output": tensor(batch, pooled_dim)}]]``."""
    g = _gen(seed)

    def one():
        return [[torch.randn(batch, tokens, context_dim, generator=g),
                 {"pooled_output": torch.randn(batch, pooled_dim, generator=g)}]]
    return one(), one()


# --------------------------------------------------------------------------------------------
# Wan 2.1 T2V
# --------------------------------------------------------------------------------------------

WAN_LATENT_SHAPE = (1, 16, 2, 8, 8)
WAN_TEXT_DIM = 4096  # WanModel's text_dim is not inferred from weights: always 4096 in ComfyUI


def tiny_wan21_config(num_layers: int = 2, dim: int = 128, ffn_dim: int = 256) -> dict:
    """The WanModel config ComfyUI infers for :func:`tiny_wan21_state_dict`.
    ComfyUI infers ``num_heads = dim // 128``, so dim must be a multiple of 128 (128 -> 1 head)."""
    if dim % 128:
        raise ValueError("Wan dim must be a multiple of 128 (ComfyUI infers num_heads = dim // 128)")
    return {
        "image_model": "wan2.1", "model_type": "t2v", "dim": dim, "out_dim": 16,
        "num_heads": dim // 128, "ffn_dim": ffn_dim, "num_layers": num_layers,
        "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16,
    }


def tiny_wan21_state_dict(seed: int = 0, num_layers: int = 2, dim: int = 128, ffn_dim: int = 256) -> StateDict:
    """Raw Wan 2.1 T2V weights (~1.1M params with the defaults; 0.5M of them in
    ``text_embedding.0`` because the text width is fixed at 4096)."""
    import_comfy()
    from comfy.ldm.wan.model import WanModel
    cfg = tiny_wan21_config(num_layers, dim, ffn_dim)
    m = WanModel(**cfg, dtype=torch.float32, device="cpu", operations=_ops())
    return _module_state_dict(m, seed)


def load_tiny_wan21(seed: int = 0, num_layers: int = 2, state_dict: Optional[StateDict] = None,
                    return_state_dict: bool = False, model_options: Optional[dict] = None):
    """ModelPatcher for a tiny Wan 2.1 T2V (``comfy.model_base.WAN21``, flow, shift 8) through
    ``comfy.sd.load_diffusion_model_state_dict``. Latent: ``WAN_LATENT_SHAPE`` ([1,16,T,H,W]);
    conditioning: :func:`tiny_wan_conditioning`."""
    import_comfy()
    import comfy.sd
    sd = state_dict if state_dict is not None else tiny_wan21_state_dict(seed, num_layers)
    patcher = comfy.sd.load_diffusion_model_state_dict(_copy_sd(sd), model_options=model_options or {})
    if patcher is None:
        raise RuntimeError("ComfyUI did not recognise the tiny Wan 2.1 state dict")
    return (patcher, sd) if return_state_dict else patcher


def tiny_wan_conditioning(seed: int = 0, tokens: int = 8, batch: int = 1) -> Tuple[list, list]:
    """(positive, negative) CONDITIONING for :func:`load_tiny_wan21`:
    ``[[tensor(batch, tokens, 4096), {}]]`` (UMT5-XXL width)."""
    g = _gen(seed)

    def one():
        return [[torch.randn(batch, tokens, WAN_TEXT_DIM, generator=g), {}]]
    return one(), one()


# --------------------------------------------------------------------------------------------
# Text encoders
# --------------------------------------------------------------------------------------------

TINY_CLIP_L_CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                      "num_hidden_layers": 2, "projection_dim": 32}


def tiny_clip_l_state_dict(seed: int = 0, config: Optional[dict] = None) -> StateDict:
    """Raw CLIP-L text weights (``text_model.*`` + ``text_projection.weight``), tiny config:
    hidden 32, 2 layers, vocab 49408 (the real tokenizer's), 77 positions (~1.6M params)."""
    import_comfy()
    import comfy.clip_model
    import comfy.sd1_clip
    base = os.path.join(os.path.dirname(os.path.realpath(comfy.sd1_clip.__file__)), "sd1_clip_config.json")
    with open(base) as f:
        full = json.load(f)
    full.update(config or TINY_CLIP_L_CONFIG)
    m = comfy.clip_model.CLIPTextModel(full, torch.float32, "cpu", _ops())
    sd = _module_state_dict(m, seed)
    return sd


def _te_options(dtype) -> dict:
    return {} if dtype is None else {"dtype": dtype}


def load_tiny_clip_l(seed: int = 0, return_state_dict: bool = False, config: Optional[dict] = None,
                     dtype: Optional[torch.dtype] = None):
    """``comfy.sd.CLIP`` (SD1 CLIP-L: ``sd1_clip.SD1ClipModel`` + real CLIP tokenizer) through
    ``comfy.sd.load_text_encoder_state_dicts([sd], model_options={"model_config": cfg})``.
    ``clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)`` gives
    cond (1, 77, 32) and pooled (1, 32) (pooled not projected, as for SD1).
    ``dtype`` None keeps ComfyUI's choice (``model_management.text_encoder_dtype``: float16 on
    CPU unless --fp32-text-enc); pass ``torch.float32`` for full-precision weights."""
    import_comfy()
    import comfy.sd
    cfg = dict(config or TINY_CLIP_L_CONFIG)
    sd = tiny_clip_l_state_dict(seed, cfg)
    # load_text_encoder_state_dicts -> text_encoders.long_clipl.model_options_long_clip rewrites
    # model_options["clip_l_model_config"] from model_options["model_config"] (+ the position count
    # read from the weights, written into that dict), so the override must go in "model_config".
    clip = comfy.sd.load_text_encoder_state_dicts([_copy_sd(sd)], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION,
                                                  model_options={"model_config": dict(cfg), **_te_options(dtype)})
    return (clip, sd) if return_state_dict else clip


TINY_T5_CONFIG = {"d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 2}


def tiny_t5_state_dict(seed: int = 0, config: Optional[dict] = None) -> StateDict:
    """Raw T5 encoder weights (``shared.weight``, ``encoder.block.N...``), T5-base layout
    (relu, not gated) shrunk to d_model 32, 2 blocks, vocab 32128 (~1.1M params)."""
    import_comfy()
    import comfy.text_encoders.t5
    import comfy.text_encoders.sa_t5
    base = os.path.join(os.path.dirname(os.path.realpath(comfy.text_encoders.sa_t5.__file__)), "t5_config_base.json")
    with open(base) as f:
        full = json.load(f)
    full.update(config or TINY_T5_CONFIG)
    m = comfy.text_encoders.t5.T5(full, torch.float32, "cpu", _ops())
    return _module_state_dict(m, seed)


def load_tiny_t5(seed: int = 0, return_state_dict: bool = False, config: Optional[dict] = None,
                 dtype: Optional[torch.dtype] = None):
    """``comfy.sd.CLIP`` holding a tiny T5 encoder, through ``comfy.sd.load_text_encoder_state_dicts``.

    Why T5-base and not the SD3/Flux ``t5xxl`` or Wan ``umt5xxl``: ``comfy.sd.detect_te_model``
    only calls a state dict T5-XXL when it has ``encoder.block.23...wi_1.weight`` with input width
    4096 (24 blocks of d_model 4096: billions of weights), so a small T5 can never take the
    ``t5xxl``/``umt5xxl`` path; UMT5 also needs a sentencepiece model that is not in the checkout.
    A 2-block T5 is detected as ``TEModel.T5_BASE`` and loaded as ``text_encoders.sa_t5.SAT5Model``
    (the Stable Audio T5-base) with the real T5 tokenizer (``comfy/text_encoders/t5_tokenizer``)
    and the config override ``model_options={"t5base_model_config": cfg}``; the T5 code and the
    encode path (attention masks, relative position buckets) are the same as t5xxl's.
    Encoding gives cond (1, >=128 tokens, 32) (the tokenizer pads to 128), pooled None.
    ``dtype``: as for :func:`load_tiny_clip_l` (None: ComfyUI's choice, float16 on CPU).
    """
    import_comfy()
    import comfy.sd
    cfg = dict(config or TINY_T5_CONFIG)
    sd = tiny_t5_state_dict(seed, cfg)
    clip = comfy.sd.load_text_encoder_state_dicts([_copy_sd(sd)], clip_type=comfy.sd.CLIPType.STABLE_AUDIO,
                                                  model_options={"t5base_model_config": cfg, **_te_options(dtype)})
    return (clip, sd) if return_state_dict else clip


# --------------------------------------------------------------------------------------------
# VAE
# --------------------------------------------------------------------------------------------

def tiny_vae_config(ch: int = 32, ch_mult=(1, 1, 1, 1), num_res_blocks: int = 1, z_channels: int = 4) -> dict:
    """``config`` for ``comfy.sd.VAE``: an SD-style AutoencoderKL with 4 levels (downscale 8,
    as ``comfy.sd.VAE`` assumes when given a config). GroupNorm uses 32 groups, so ``ch``
    (and every ``ch * mult``) must be a multiple of 32."""
    ddconfig = {"double_z": True, "z_channels": z_channels, "resolution": 256, "in_channels": 3,
                "out_ch": 3, "ch": ch, "ch_mult": list(ch_mult), "num_res_blocks": num_res_blocks,
                "attn_resolutions": [], "dropout": 0.0}
    return {"params": {"embed_dim": z_channels, "ddconfig": ddconfig}}


def tiny_vae_state_dict(seed: int = 0, config: Optional[dict] = None) -> StateDict:
    """Raw AutoencoderKL weights (``encoder.*``, ``decoder.*``, ``quant_conv``, ``post_quant_conv``)."""
    import_comfy()
    from comfy.ldm.models.autoencoder import AutoencoderKL
    cfg = config or tiny_vae_config()
    m = AutoencoderKL(**cfg["params"])
    return _module_state_dict(m, seed)


def load_tiny_vae(seed: int = 0, return_state_dict: bool = False, config: Optional[dict] = None):
    """``comfy.sd.VAE`` (4 latent channels, x8) through ``comfy.sd.VAE(sd=..., config=...)``;
    ch 32, ch_mult (1,1,1,1), 1 res block (~0.37M params, float32 on CPU). decode [1,4,8,8] ->
    [1,64,64,3]; encode [1,64,64,3] -> [1,4,8,8]; ``decode_tiled`` / ``encode_tiled`` work too.
    Call ``encode_tiled`` under ``torch.inference_mode()`` as ComfyUI's executor does: outside
    it ComfyUI's ``encode_tiled_`` fails ("Inplace update to inference tensor outside
    InferenceMode") because ``comfy.utils.tiled_scale`` returns an inference tensor."""
    import_comfy()
    import comfy.sd
    cfg = config or tiny_vae_config()
    sd = tiny_vae_state_dict(seed, cfg)
    vae = comfy.sd.VAE(sd=_copy_sd(sd), config=cfg)
    return (vae, sd) if return_state_dict else vae


# --------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------

def _default_lora_filter(key: str) -> bool:
    return (".attn." in key or ".mlp." in key or ".self_attn." in key or ".cross_attn." in key
            or ".ffn." in key)


def tiny_lora_for(state_dict_or_model, seed: int = 0, rank: int = 4, scale: float = 1.0,
                  key_filter: Optional[Callable[[str], bool]] = None, prefix: Optional[str] = None,
                  alpha: Optional[float] = None) -> StateDict:
    """A LoRA dict in ComfyUI's generic key format for a model's 2-D (Linear) weights:
    ``<prefix><key>.lora_up.weight`` (out, rank), ``.lora_down.weight`` (rank, in) and
    ``.alpha`` (= rank unless given), which ``comfy.lora.model_lora_keys_unet`` (prefix
    ``diffusion_model.``) / ``model_lora_keys_clip`` (prefix ``text_encoders.``) map and
    ``comfy.sd.load_lora_for_models(model, clip, lora, 1.0, 1.0)`` applies.

    ``state_dict_or_model``: a raw diffusion-model state dict (as from :func:`tiny_sd3_state_dict`
    / :func:`tiny_wan21_state_dict`), a ``ModelPatcher``, a ``BaseModel``, a ``comfy.sd.CLIP``
    or a text-encoder state dict (``clip.cond_stage_model.state_dict()``; pass
    ``prefix="text_encoders."``). ``prefix`` None: ``text_encoders.`` for a CLIP object, else
    ``diffusion_model.``. By default targets the attention / MLP linears in the blocks
    (``key_filter`` picks others). lora_up is non-zero, so the patch measurably changes the
    output (delta ~ ``scale`` x the weight's size).
    """
    sd = state_dict_or_model
    if hasattr(sd, "cond_stage_model") and hasattr(sd, "patcher"):  # comfy.sd.CLIP
        sd = sd.cond_stage_model
        prefix = "text_encoders." if prefix is None else prefix
    if prefix is None:
        prefix = "diffusion_model."
    if hasattr(sd, "model") and hasattr(sd, "patches"):  # ModelPatcher
        sd = sd.model
    if hasattr(sd, "diffusion_model"):  # comfy BaseModel
        sd = sd.diffusion_model
    if isinstance(sd, torch.nn.Module):
        sd = sd.state_dict()
    flt = key_filter or _default_lora_filter
    g = _gen(seed)
    out: StateDict = {}
    for k in sorted(sd):
        t = sd[k]
        if not k.endswith(".weight") or t.ndim != 2 or not flt(k):
            continue
        base = prefix + k[:-len(".weight")]
        n_out, n_in = t.shape
        out[base + ".lora_down.weight"] = torch.randn(rank, n_in, generator=g) / math.sqrt(n_in)
        out[base + ".lora_up.weight"] = torch.randn(n_out, rank, generator=g) * (scale / math.sqrt(rank))
        out[base + ".alpha"] = torch.tensor(float(alpha if alpha is not None else rank))
    if not out:
        raise ValueError("tiny_lora_for: no 2-D weights matched")
    return out


# --------------------------------------------------------------------------------------------
# Optional extras: ESRGAN upscaler (spandrel), CLIP vision
# --------------------------------------------------------------------------------------------

def tiny_esrgan_state_dict(seed: int = 0, num_filters: int = 8, num_blocks: int = 1, scale: int = 2) -> StateDict:
    """Raw old-arch ESRGAN weights (``model.0.weight``, ``model.1.sub.0.RDB1...``); spandrel's
    RRDB growth width is fixed at 32, so num_filters 8 / 1 block is ~0.1M params."""
    from spandrel.architectures.ESRGAN import ESRGAN
    m = ESRGAN(in_nc=3, out_nc=3, num_filters=num_filters, num_blocks=num_blocks, scale=scale)
    return _module_state_dict(m, seed, gain=0.5)


def load_tiny_esrgan(seed: int = 0, scale: int = 2, return_state_dict: bool = False):
    """spandrel ``ImageModelDescriptor`` (what ComfyUI's ``UpscaleModelLoader`` returns), for
    ``comfy_extras.nodes_upscale_model.ImageUpscaleWithModel``; x``scale``."""
    sd = tiny_esrgan_state_dict(seed, scale=scale)
    desc = load_upscale_model_file(sd)
    return (desc, sd) if return_state_dict else desc


def load_upscale_model_file(sd: StateDict):
    """What ComfyUI's ``UpscaleModelLoader`` node returns for a file holding ``sd``: the node
    itself runs on a temporary file, so the descriptor is exactly the host's (newer hosts attach
    a ``patcher`` to it, older ones do not)."""
    import_comfy()
    import folder_paths
    from safetensors.torch import save_file
    from comfy_extras.nodes_upscale_model import UpscaleModelLoader

    d = tempfile.mkdtemp(prefix="tiny_upscale_")
    name = "tiny_esrgan.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, name))
    folder_paths.add_model_folder_path("upscale_models", d)
    loader = UpscaleModelLoader()
    load = getattr(loader, "load_model", None) or loader.execute
    out = load(name)
    return out.result[0] if hasattr(out, "result") else out[0]


TINY_CLIP_VISION_CONFIG = {
    "attention_dropout": 0.0, "dropout": 0.0, "hidden_act": "quick_gelu", "hidden_size": 32,
    "image_size": 32, "initializer_factor": 1.0, "initializer_range": 0.02,
    "intermediate_size": 64, "layer_norm_eps": 1e-5, "model_type": "clip_vision_model",
    "num_attention_heads": 2, "num_channels": 3, "num_hidden_layers": 2, "patch_size": 8,
    "projection_dim": 16, "torch_dtype": "float32",
}


def load_tiny_clip_vision(seed: int = 0, return_state_dict: bool = False, config: Optional[dict] = None):
    """``comfy.clip_vision.ClipVisionModel`` with a tiny ViT (32px, patch 8, hidden 32, 2 layers).

    ``comfy.clip_vision.load_clipvision_from_sd`` picks one of its bundled full-size JSON configs
    from the key names (ViT-L needs layer 22 to exist, etc.), so a small model cannot go through
    it; instead this writes the small config to a temp JSON and uses ``ClipVisionModel(json)``
    + ``load_sd`` (the same two calls ``load_clipvision_from_sd`` makes).
    ``encode_image(image[B,H,W,3])`` gives image_embeds (B, 16), last_hidden_state (B, 17, 32).
    Weights are in ``model_management.text_encoder_dtype()`` (float16 on CPU), as ComfyUI does.
    """
    import_comfy()
    import comfy.clip_vision
    import comfy.clip_model
    cfg = dict(config or TINY_CLIP_VISION_CONFIG)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="tiny_clip_vision_")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f)
        cv = comfy.clip_vision.ClipVisionModel(path)
    finally:
        os.unlink(path)
    ref = comfy.clip_model.CLIPVisionModelProjection(cfg, torch.float32, "cpu", _ops())
    sd = _module_state_dict(ref, seed)
    m, u = cv.load_sd(_copy_sd(sd))
    if m or u:
        raise RuntimeError(f"tiny clip vision: missing {m}, unexpected {u}")
    return (cv, sd) if return_state_dict else cv


# --------------------------------------------------------------------------------------------
# Small conveniences for tests
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def torch_threads(n: int = 1):
    """Run with ``torch.set_num_threads(n)``, restoring the old count afterwards.

    These models are so small that threading buys nothing, while on a loaded 2-core host every
    parallel region waits for a descheduled worker: a first tiled VAE decode measured 5-19 s with
    2 threads under load and 0.4 s with 1. Tests wrap their model runs in this.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def seeded_noise(shape: Iterable[int], seed: int = 0) -> torch.Tensor:
    """Noise as ``comfy.sample.prepare_noise`` draws it (CPU, float32, seeded)."""
    import_comfy()
    import comfy.sample
    return comfy.sample.prepare_noise(torch.zeros(tuple(shape)), seed)


def sample(model, positive, negative, latent_shape, steps: int = 2, cfg: float = 2.0, seed: int = 0,
           sampler_name: str = "euler", scheduler: str = "simple", denoise: float = 1.0) -> torch.Tensor:
    """``comfy.sample.sample`` from an empty latent with seeded noise; returns the latent."""
    import_comfy()
    import comfy.sample
    latent = torch.zeros(tuple(latent_shape))
    latent = comfy.sample.fix_empty_latent_channels(model, latent)
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                               denoise=denoise, disable_pbar=True, seed=seed)
