"""Real models at full size, before downloading them: activations per block and the smallest budget.

    COMFYUI_PATH=... python bench/full_size.py [--only NAME] > docs/full_size.md

The page ends with the stamp (commit, date, machine: ``bench/docgen.py``);
tests/comfy/test_generated_docs.py checks that the file is what this script writes now.

For each model the host's own class is built at the size of the released checkpoint on the meta
device (no weights are allocated: every parameter is a shape and a dtype), in the dtype users run
(bf16), through the host's model config (``model_detection.model_config_from_unet_config``, the
class the loader would pick). The configuration is written here as the loader's detection would
read it from the checkpoint, and checked against it: ``detect_unet_config`` on the meta state dict
must give the same values. The inputs are the tensors ``BaseModel`` hands the diffusion module
for one step at the stated resolution (latent cast to the model dtype, text context at the length
ComfyUI's tokenizer pads to, or for encoders that do not pad the length the node's plan preview
assumes: ``nodes/preview.py``). The forward is dry-run by ``Engine`` exactly as the first forward of
a workflow is: units found by ``find_units``, ``trace_units`` on fake tensors, and the plan built
from the traced figures at a budget of one byte, which is refused with the smallest budget that
plans (``plan.min_budget``, default options: prefetch on, residency on).

Attention is ComfyUI's PyTorch attention (``scaled_dot_product_attention``), the default on NVIDIA
GPUs; the fakes are CPU tensors, so the kernels' memory is what their CPU implementations declare
(the fused attention: output and log-sum-exp, no score matrix, as flash attention on CUDA).
Nothing here allocates a full-size tensor: fake tensors have no storage.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

BF16 = torch.bfloat16


@dataclasses.dataclass
class Model:
    name: str
    config_class: str  # the supported_models class the loader picks
    unet_config: dict  # as model_detection reads it from the released checkpoint
    shape: str  # the resolution, for the table
    inputs: dict  # name -> (shape, dtype) of the diffusion module's tensor inputs, in call order
    assumptions: str


# unet_config values: model_detection.detect_unet_config's formulas on the released checkpoints'
# tensor shapes (hidden sizes from img_in / head.modulation, depths from the block counts).
MODELS = [
    Model("Flux.1-dev", "Flux",
          dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
               hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38,
               axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True,
               txt_ids_dims=[]),
          "1024×1024", dict(x=((1, 16, 128, 128), BF16), timestep=((1,), torch.float32),
                            context=((1, 256, 4096), BF16), y=((1, 768), BF16), guidance=((1,), torch.float32)),
          "latent 16×128×128 (4096 image tokens); T5 context 256 tokens (ComfyUI pads T5 to 256); batch 1"),
    Model("Wan 2.2 T2V A14B (one expert)", "WAN21_T2V",
          dict(image_model="wan2.1", model_type="t2v", dim=5120, out_dim=16, num_heads=40, ffn_dim=13824,
               num_layers=40, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
               cross_attn_norm=True, eps=1e-6, in_dim=16),
          "832×480, 81 frames", dict(x=((1, 16, 21, 60, 104), BF16), timestep=((1,), torch.float32),
                                     context=((1, 512, 4096), BF16)),
          "latent 16×21×60×104 (32760 tokens); umT5 context 512 tokens (ComfyUI pads to 512); batch 1; "
          "each expert is its own diffusion model (the high-noise and low-noise experts are the same size)"),
    Model("Qwen-Image", "QwenImage",
          dict(image_model="qwen_image", in_channels=64, num_layers=60),
          "1328×1328", dict(x=((1, 16, 1, 166, 166), BF16), timestep=((1,), torch.float32),
                            context=((1, 256, 3584), BF16)),
          "latent 16×166×166 (6889 image tokens); Qwen2.5-VL context 256 tokens (ComfyUI does not pad: 256 "
          "stands for a long prompt, as the node's plan preview assumes); batch 1"),
    Model("HunyuanVideo 1.5 720p", "HunyuanVideo15",
          dict(image_model="hunyuan_video", in_channels=65, patch_size=[1, 1, 1], out_channels=32, vec_in_dim=None,
               axes_dim=[16, 56, 56], meanflow=False, context_in_dim=3584, hidden_size=2048, mlp_ratio=4.0,
               num_heads=16, depth=54, depth_single_blocks=0, theta=256, qkv_bias=True, byt5=True,
               guidance_embed=False, use_cond_type_embedding=True, vision_in_dim=1152, meanflow_sum=True),
          "1280×720, 121 frames", dict(x=((1, 65, 31, 45, 80), BF16), timestep=((1,), torch.float32),
                                       context=((1, 256, 3584), BF16)),
          "latent 32×31×45×80 plus 33 conditioning channels (111600 tokens); Qwen2.5-VL context 256 tokens "
          "(a long prompt, as the node's plan preview assumes), "
          "no ByT5 glyph text, no reference image (text to video); batch 1"),
]


def import_host():
    import tiny_models as tm
    path = tm.comfyui_path()
    if path is None:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    # first on the path, once: ahead of this checkout (whose nodes/ would shadow the host's nodes)
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    from comfy.cli_args import args
    args.use_pytorch_cross_attention = True  # before model_management: the attention GPU users run
    tm.import_comfy()
    import comfy.ldm.modules.attention as attention
    import comfy.model_detection
    return comfy, attention


def build(spec: Model):
    import comfy.model_detection
    cfg = comfy.model_detection.model_config_from_unet_config(dict(spec.unet_config))
    if cfg is None or type(cfg).__name__ != spec.config_class:
        raise RuntimeError(f"the host picks {type(cfg).__name__ if cfg else None}, not {spec.config_class}")
    cfg.set_inference_dtype(BF16, None)
    model = cfg.get_model({}, device="meta")
    return cfg, model.diffusion_model


def detection_mismatches(spec: Model, dm) -> list[str]:
    """Keys of ``spec.unet_config`` the host's detection reads differently from the built model's
    state dict (shapes only: meta tensors)."""
    import comfy.model_detection
    sd = dm.state_dict()
    got = comfy.model_detection.detect_unet_config(sd, "") or {}
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    return [f"{k}: {got.get(k)!r} != {v!r}" for k, v in spec.unet_config.items()
            if k in got and norm(got[k]) != norm(v)]


def inputs(spec: Model):
    g = torch.Generator().manual_seed(0)
    kw = {}
    for k, (shape, dtype) in spec.inputs.items():
        kw[k] = (torch.rand(shape, generator=g) if dtype is torch.float32 else torch.randn(shape, generator=g)).to(dtype)
    kw["timestep"] = torch.tensor([0.5])
    kw["transformer_options"] = {}
    return kw


def gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def run(spec: Model) -> dict:
    import vramcut_core as core
    from vramcut_core.planning.budget import BudgetError, gib_text
    from vramcut_core.planning.plan import min_budget

    t0 = time.perf_counter()
    cfg, dm = build(spec)
    build_s = time.perf_counter() - t0
    # a module the host builds without the device argument is real (HunyuanVideo 1.5's
    # cond_type_embedding: 3x2048 fp32): allowed when small, and listed
    real = [(n, t.numel() * t.element_size()) for n, t in [*dm.named_parameters(), *dm.named_buffers()]
            if not t.is_meta]
    if sum(b for _, b in real) > 1 << 20:
        raise RuntimeError(f"{spec.name}: weights were allocated: {real[:5]}")
    mism = detection_mismatches(spec, dm)
    eng = core.Engine(dm, core.EngineConfig(budget_bytes=1, device="cpu"))
    kw = inputs(spec)
    x, t, c = kw.pop("x"), kw.pop("timestep"), kw.pop("context")
    err = None
    try:
        with torch.inference_mode():  # as ComfyUI runs a prompt
            eng.run(dm, x, t, c, **kw)
    except BudgetError as e:
        err = e
    tr = next(iter(eng.traces.values()))
    row = dict(name=spec.name, shape=spec.shape, assumptions=spec.assumptions, config_class=type(cfg).__name__,
               params=sum(p.numel() for p in dm.parameters()),
               weight_bytes=eng.unitset.weight_bytes, units=len(eng.unitset.units),
               blocks=sum(u.kind == "block" for u in eng.unitset.units), family=eng.unitset.label,
               build_s=build_s, trace_s=tr.seconds, detection=mism, reason=tr.reason, real=real)
    if tr.measurements is None:
        return row
    if err is None or not err.exact:
        raise RuntimeError(f"{spec.name}: a budget of one byte was not refused with an exact minimum: {err!r}")
    by = {u.name: u for u in eng.unitset.units}
    blocks = {n: m for n, m in tr.measurements.items() if by[n].kind == "block"}
    biggest = max(blocks, key=lambda n: (by[n].weight_bytes, n))
    worst = max(blocks, key=lambda n: blocks[n].peak_bytes)
    # the same plan kept to whole units (no finer cut): what it costs to keep every block in one piece
    meas = dict(tr.measurements)
    order = list(meas) + [u.name for u in eng.unitset.units if u.name not in meas]
    whole = min_budget([eng.planner.plan_unit(by[n], meas) for n in order], eng.config.options, None)
    row.update(whole_budget_gb=gib_text(whole) if whole else "none")
    row.update(peak_max=blocks[worst].peak_bytes, peak_max_unit=worst, added_max=max(m.activation_bytes for m in blocks.values()),
               biggest=biggest, biggest_bytes=by[biggest].weight_bytes, biggest_peak=blocks[biggest].peak_bytes,
               forward_peak=tr.peak_bytes, min_budget=err.min_budget_bytes, min_budget_gb=err.min_budget_gb)
    return row


HEADER = """# Real models at full size: activations per block and the smallest budget

Dry runs on ComfyUI {host}, on CPU without weights (the stamp at the end says when and where): each
model's ComfyUI class is built at the released checkpoint's size on the
meta device in bf16 (the config class the loader picks, its configuration checked against the
host's own detection on the built state dict), and one sampling step at the stated shape is
dry-run the way Max VRAM plans a first forward: units found by `find_units`, activation bytes
traced on fake tensors (`trace_units`), the plan built from them (default options: prefetch on,
residency on). "Smallest max_vram_gb" is the budget `plan.min_budget` gives, the number the node
would ask for when the budget is too small: at it the blocks are cut into their parts and nearly
every weight is copied in each step (slow; it says what fits, not what is fast). "Smallest keeping
blocks whole" is the same search without the finer cut: two block slots (prefetch) beside the
activations.
Activation peak per block: the most live activation bytes while the block runs (its inputs
included), the figure the plan reserves. Attention: {attention} (ComfyUI's default on NVIDIA).
Text encoder and VAE are separate models with their own budgets; they are not in these numbers.
Batch 1 is one conditioning pass: with CFG above 1, ComfyUI batches the positive and negative
prompts together when it estimates the memory allows, and the activations then about double.
"""


def table(rows: list[dict]) -> str:
    out = ["| model | shape | weights (bf16) | units | activation peak per block: max (block) | "
           "largest block: weights, activation peak | whole forward peak | smallest max_vram_gb | "
           "smallest keeping blocks whole |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = f"{gib(r['weight_bytes'])} ({r['params'] / 1e9:.1f} B params)"
        u = f"{r['units']} ({r['blocks']} blocks)"
        if r["reason"]:
            out.append(f"| {r['name']} | {r['shape']} | {w} | {u} | not traced: {r['reason']} | | | | |")
            continue
        out.append(f"| {r['name']} | {r['shape']} | {w} | {u} | {gib(r['peak_max'])} (`{r['peak_max_unit']}`) | "
                   f"{gib(r['biggest_bytes'])}, {gib(r['biggest_peak'])} (`{r['biggest']}`) | "
                   f"{gib(r['forward_peak'])} | **{r['min_budget_gb']}** | {r['whole_budget_gb']} |")
    out.append("")
    out.append("Assumptions per model (the inputs of one step; a longer prompt or a larger batch raises the "
               "activations):\n")
    for r in rows:
        det = "matches the host's detection" if not r["detection"] else "DIFFERS from detection: " + "; ".join(r["detection"])
        real = "".join(f" `{n}` ({b} B) is built outside the meta device by the host (not passed the device): "
                       f"real, and counted." for n, b in r["real"])
        out.append(f"- **{r['name']}** ({r['config_class']}, {r['family']}): {r['assumptions']}. "
                   f"Configuration {det}.{real}")
    return "\n".join(out)


def document(rows: list[dict], host: str, attention: str) -> str:
    """The page without its stamp."""
    return HEADER.format(host=host, attention=attention) + "\n" + table(rows) + "\n"


def host_and_attention() -> tuple[str, str]:
    import tiny_models as tm
    import comfy.ldm.modules.attention as attention
    return (os.path.basename(os.path.dirname(tm.comfyui_path())) or tm.comfyui_path(),
            attention.optimized_attention.__name__)


def main(argv: list[str]) -> int:
    import docgen
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="one model (a substring of its name)")
    a = ap.parse_args(argv)
    import_host()
    t0 = time.perf_counter()
    rows = []
    for spec in MODELS:
        if a.only and a.only.lower() not in spec.name.lower():
            continue
        rows.append(run(spec))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{spec.name}: traced in {rows[-1]['trace_s']:.1f} s, max RSS {rss:.0f} MiB", file=sys.stderr)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(document(rows, *host_and_attention()))
    print(docgen.stamp("COMFYUI_PATH=... python bench/full_size.py > docs/full_size.md",
                       f"The whole table took {time.perf_counter() - t0:.0f} s, the process's largest resident "
                       f"memory {rss:.0f} MiB."))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
