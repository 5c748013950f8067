"""Predicted time per call at a budget, and the split over two GPUs, for the full-size models.

    COMFYUI_PATH=... python bench/predict_table.py [--only NAME] > docs/predicted.md

The page ends with the stamp (``bench/docgen.py``); tests/comfy/test_generated_docs.py checks that
the file is what this script writes now (one model regenerated).

The models, their shapes and their dry runs are bench/full_size.py's (the host's own classes at
the released size on the meta device, one call traced on fake tensors: activations and FLOPs per
unit at the model's shape). Two tables come from them:

* Time per call (predicted). A published resident time per call (``PUBLISHED``: the source, the
  setting, and how it was turned into one call) is spread over the units a call enters in
  proportion to each unit's FLOPs from the dry run (``timeline.with_compute_times`` at the rate
  that makes the sum the published time); where the published run was at another shape, the
  time is first scaled by the ratio of the dry run's FLOPs at the two shapes. Each budget is
  planned as many as fit (``plan.make_plan``) and by time (``residency.by_time``), and each plan's
  steady call is predicted by the timeline model (``timeline.predict``: prefetch overlapping the
  compute before it) at the link's rate. No published time, no rows.
* Two GPUs (``placement.place``) against one: host-link bytes per call, hops and hop bytes
  (the activations crossing the cut), from the traced figures where the dry run ran, else from
  the weights alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import decimal
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

GIB = 1 << 30
BUDGETS_GIB = (6, 8, 12, 16)
LINKS = (("PCIe 4.0 x16", 25e9), ("PCIe 5.0 x16", 50e9))
PAIRS_GIB = (12, 16)  # two GPUs of this many GiB each, against one
TIER_PAIRS_GIB = ((12, 32), (16, 32), (16, 64), (24, 64))   # (VRAM, RAM) budgets of the host tiers
DISKS = (("NVMe 3.5 GB/s", 3.5e9), ("NVMe 7 GB/s", 7e9))     # stated sequential read rates (PCIe 4.0 / 5.0 NVMe)


@dataclasses.dataclass(frozen=True)
class Published:
    """A resident time per call taken from a published run, and what is known of that run."""

    model: str            # full_size.MODELS name
    per_call_s: float     # the published time turned into one call of the diffusion model
    inputs: dict | None   # the published run's input shapes where they differ from full_size's (None: same)
    shape: str            # the published run's shape, in words
    source: str           # where it was published
    note: str             # the run and the conversion, with what is and is not known


# Only figures found in a published source; a model without one has no time rows.
PUBLISHED = [
    Published(
        "Wan 2.2 T2V A14B (one expert)", 74.63497 / (40 * 2),
        dict(x=((1, 16, 21, 90, 160), "bf16"), timestep=((1,), "fp32"), context=((1, 512, 4096), "bf16")),
        "1280×720, 81 frames",
        "vllm-omni PR #1223 (https://github.com/vllm-project/vllm-omni/pull/1223)",
        "text to video on an NVIDIA H100 80GB HBM3, no offloading: 74634.97 ms for the whole generation "
        "(layerwise offloading: 77303.84 ms, +3.6 %). The PR names the project's offline text-to-video "
        "example without its arguments; that example's defaults then were Wan2.2-T2V-A14B, 1280×720, "
        "81 frames, 40 steps, guidance 4.0 (two calls per step: conditional and unconditional), so "
        "74.635 s / 80 calls = 0.933 s per call. An upper bound: the whole generation includes the text "
        "encoder, the VAE decode and the switch between the two experts. Scaled to 832×480 by the dry "
        "run's FLOPs at the two shapes"),
    Published(
        "Qwen-Image", 15.45 / (50 * 2), None, "not stated",
        "sglang PR #16150 (https://github.com/sgl-project/sglang/pull/16150)",
        "`sglang generate --model-path=Qwen/Qwen-Image` without layerwise offload: \"Pixel data "
        "generated successfully in 15.45 seconds\" (with it: 74.85 s). The GPU is not named (peak 45.85 GB "
        "plus 33.80 GB remaining: an 80 GB card). Steps and guidance are sglang's Qwen-Image defaults "
        "(50 steps, guidance 4.0 with a negative prompt: two calls per step), so 15.45 s / 100 calls "
        "per call, an upper bound (text encoding and VAE decode included; both runs, with and "
        "without layerwise offload, were started with `--text-encoder-cpu-offload --pin-cpu-memory`: "
        "the text encoder's weights were kept in host memory, so its copies are in both times too). The resolution is "
        "not stated and sglang's default was not confirmed here: the time is used at 1328×1328 "
        "unscaled (if the run was smaller, the true time per call at 1328×1328 is longer, and "
        "streaming hides better than predicted here)"),
    Published(
        "Flux.1-dev", 6.936 / 28,
        dict(x=((1, 16, 128, 128), "bf16"), timestep=((1,), "fp32"), context=((1, 512, 4096), "bf16"),
             y=((1, 768), "bf16"), guidance=((1,), "fp32")),
        "1024×1024, T5 context 512 tokens",
        "Hugging Face blog, \"Productionizing diffusion\" part 1 "
        "(https://github.com/huggingface/blog/blob/main/productionizing-diffusion-1.md)",
        "diffusers' FluxPipeline in bf16 on the GPU (no offloading, no compile), after two warm-up runs, "
        "1024×1024, 28 steps, guidance 4.0 (Flux.1-dev is guidance-distilled: one call per step): "
        "\"This takes `15.815` seconds on an A100 80GB and `6.936` seconds on an H100\", end to end. "
        "On the A100 the same post times the parts: text encoders 0.060 s, denoiser 15.708 s, VAE 0.164 s. "
        "So 6.936 s / 28 calls = 0.248 s per call on the H100, an upper bound (text encoders and VAE "
        "included, about 1.4 % of the whole on the A100). diffusers pads the T5 prompt to 512 tokens, "
        "ComfyUI to 256: scaled by the dry run's FLOPs at the two shapes"),
    Published(
        "HunyuanVideo 1.5 720p", 334.7 / (30 * 2),
        dict(x=((1, 65, 9, 45, 80), "bf16"), timestep=((1,), "fp32"), context=((1, 256, 3584), "bf16")),
        "1280×720, 33 frames",
        "vllm-omni PR #1516 (https://github.com/vllm-project/vllm-omni/pull/1516), its HunyuanVideo-1.5 "
        "performance benchmark report",
        "the diffusers baseline (diffusers 0.37.0, SDPA attention) of text to video at 720×1280, 33 frames, "
        "30 steps, BF16, guidance_scale 6.0, VAE tiling on: 334.7 s end to end on one GPU. The report "
        "names the GPU \"1× NVIDIA A100 80GB (140 GiB total)\", the PR's description an H200 with 144 GB: "
        "which of the two ran it is not settled here. Guidance 6.0 on the model that is not CFG-distilled: "
        "a conditional and an unconditional pass per step (batched or not, the same compute per sample), "
        "so 334.7 s / 60 calls = 5.578 s per call, an upper bound (text encoding and the tiled VAE decode "
        "included). The prompt's length is not stated: 256 tokens taken, as in the full-size row. Scaled "
        "from 33 to 121 frames by the dry run's FLOPs at the two shapes: an extrapolation (32400 tokens "
        "against 111600; attention grows with the square of the tokens, which the FLOP count follows)"),
]
NOT_FOUND: dict[str, str] = {}   # models without a published time (none now): the reason, on the page


# -- the tables (pure: plan units in, rows out) ------------------------------------------------

def secs(s: float) -> str:
    """Seconds, halves rounded up, after the float noise of a sum is taken off (15.45 / 100 and
    the sum of its per-unit shares both print 0.155 s)."""
    q = decimal.Decimal(repr(round(s, 9))).quantize(decimal.Decimal("0.001" if s < 10 else "0.1"),
                                                    rounding=decimal.ROUND_HALF_UP)
    return f"{q} s"


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n else "0"


def time_cells(units, budget: int, options, split_unit=None) -> list[str]:
    """Cells of one budget: for each link, the predicted call as many as fit and by time
    ("T s (R× resident)"), or one cell "refused (needs X)" for every column."""
    from vramcut_core.planning.budget import BudgetError
    from vramcut_core.planning.plan import make_plan
    from vramcut_core.planning.residency import by_time
    from vramcut_core.planning.timeline import predict

    resident = sum(u.compute_s for u in units if u.entered)
    try:
        count = make_plan(list(units), budget, options, split_unit)
    except BudgetError as e:
        need = f"{e.min_budget_gb} GiB" if e.min_budget_gb else "more"
        return [f"refused (needs {need})"] * (2 * len(LINKS))
    out = []
    for _, bps in LINKS:
        for plan in (count, by_time(count, bps, options)):
            t = predict(plan, bps).step_s
            out.append(f"{secs(t)} ({t / resident:.2f}×)")
    return out


def time_rows(name: str, units, options, budgets=BUDGETS_GIB, split_unit=None) -> list[str]:
    """The rows of ``name`` at each budget (units with their compute times)."""
    resident = sum(u.compute_s for u in units if u.entered)
    return [f"| {name} | {b} GiB | {secs(resident)} | " + " | ".join(time_cells(units, int(b * GIB), options, split_unit))
            + " |" for b in budgets]


def tier_rows(name: str, units, options, pairs=TIER_PAIRS_GIB, split_unit=None) -> list[str]:
    """For each (VRAM, RAM) pair: the plan by time on PCIe 4.0 x16, its host tiers under the RAM
    budget (``tiers.choose``: every weight read from the checkpoint itself, the bounce buffer of a
    GPU), and the predicted call at each disk's rate (``timeline.predict`` with the reads: each
    disk-tier group read when its slot frees, on the reader thread, piece by piece through the
    bounce buffer feeding its copies)."""
    from vramcut_core.planning.plan import BudgetError, make_plan
    from vramcut_core.planning.residency import by_time
    from vramcut_core.planning.tiers import HostUnit, bounce_for, choose
    from vramcut_core.planning.timeline import predict
    from vramcut_core.runtime import host_memory

    _, bps = LINKS[0]
    out = []
    for vram, ram in pairs:
        label = f"{vram} / {ram} GiB"
        try:
            plan = by_time(make_plan(list(units), int(vram * GIB), options, split_unit), bps, options)
            host = {u.name: HostUnit(u.weight_bytes, u.weight_bytes) for u in plan.units}
            t = choose(plan, host, int(ram * GIB), bounce_for(host, host_memory.BOUNCE_PIECE, host_memory.BOUNCE_PIECES))
        except BudgetError as e:
            need = f"{e.min_budget_gb} GiB" if e.min_budget_gb else "more"
            out.append(f"| {name} | {label} | refused (needs {need}) | | | " + " | " * len(DISKS))
            continue
        step = predict(plan, bps).step_s
        tiered = dataclasses.replace(plan, tiers=t)
        reads = {n: host[n].read_bytes for n in t.disk_units}
        cells = [f"{secs(predict(tiered, bps, reads=reads, disk_bytes_per_s=rate).step_s)}" for _, rate in DISKS]
        out.append(f"| {name} | {label} | {gib(plan.resident_bytes)} | {gib(t.ram_bytes - t.held_bytes)} | "
                   f"{gib(t.disk_bytes_per_call)} | {secs(step)} | " + " | ".join(cells) + " |")
    return out


def placement_rows(name: str, units, options, traced: bool, sizes=PAIRS_GIB, split_unit=None) -> list[str]:
    """For each size: one GPU of it, then two; host-link bytes, hops and hop bytes per call."""
    from vramcut_core.planning.placement import place
    from vramcut_core.planning.budget import BudgetError

    kind = "traced" if traced else "weights only"
    out = []
    for s in sizes:
        for n in (1, 2):
            devs = [(f"cuda:{i}", int(s * GIB)) for i in range(n)]
            label = f"{n}×{s} GiB" if n > 1 else f"one GPU of {s} GiB"
            try:
                p = place(list(units), devs, options, split_unit if n == 1 else None)
            except BudgetError as e:
                need = f"{e.min_budget_gb} GiB" if e.min_budget_gb else "more"
                out.append(f"| {name} | {label} | refused (needs {need}) | | | {kind} |")
                continue
            hop = mib(p.hop_bytes_per_forward) if p.hop_bytes_known else "not measured"
            spread = " + ".join(str(d.stop - d.first) for d in p.devices)
            out.append(f"| {name} | {label} | {gib(p.host_bytes_per_forward)} | {len(p.hops)} | {hop} | {kind}, "
                       f"units per GPU {spread} |")
    return out


# -- the models ---------------------------------------------------------------------------------

def dry_run(spec, inputs: dict | None = None):
    """``(plan units in execution order, traced?, split_unit, measurements, trace reason)`` of one
    call at ``spec``'s shape (or ``inputs``), as bench/full_size.py dry-runs it."""
    import torch

    import full_size as fs
    import vramcut_core as core
    from vramcut_core.planning.budget import BudgetError

    if inputs is not None:
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}
        spec = dataclasses.replace(spec, inputs={k: (s, dt[d]) for k, (s, d) in inputs.items()})
    _, dm = fs.build(spec)
    eng = core.Engine(dm, core.EngineConfig(budget_bytes=1, device="cpu"))
    kw = fs.inputs(spec)
    x, t, c = kw.pop("x"), kw.pop("timestep"), kw.pop("context")
    try:
        with torch.inference_mode():
            eng.run(dm, x, t, c, **kw)
    except BudgetError:
        pass
    tr = next(iter(eng.traces.values()))
    by = {u.name: u for u in eng.unitset.units}
    if tr.measurements is None:
        units = [eng.planner.plan_unit(u, None) for u in eng.unitset.units]
        return units, False, (lambda n: eng.planner.split(n, None)), None, tr.reason
    meas = dict(tr.measurements)
    order = list(meas) + [u.name for u in eng.unitset.units if u.name not in meas]
    units = [eng.planner.plan_unit(by[n], meas) for n in order]
    return units, True, (lambda n: eng.planner.split(n, meas)), meas, None


def total_flops(meas) -> int:
    return sum(m.flops or 0 for m in meas.values())


def timed_units(units, meas, per_call_s: float, scale: float = 1.0):
    """``units`` with compute times: ``per_call_s * scale`` spread in proportion to FLOPs."""
    from vramcut_core.planning.timeline import with_compute_times

    flops = {n: (m.flops or 0) for n, m in meas.items()}
    return with_compute_times(units, flops, total_flops(meas) / (per_call_s * scale))


HEADER = """# Predicted time per call under a budget, and the split over two GPUs

Every time on this page is **predicted** by the planner's timeline model, none is measured:
nothing here has run on a GPU. The models, their shapes and the dry runs are
[full_size.md](full_size.md)'s (ComfyUI {host}, bf16, one call traced on fake tensors on CPU:
activations and FLOPs per unit at the stated shape). A call is one forward of the diffusion model;
a sampling step with CFG is two calls.

## Time per call at a budget (predicted)

Compute per unit: a published resident time per call (below, with its source) spread over the
units a call enters (blocks, and the prelude and final layers) in proportion to each unit's
FLOPs counted in the dry run (`FlopCounterMode`), scaled by the dry run's FLOPs where the published
run was at another shape. So each row asks: a GPU that computes as fast as the published one,
with this budget and this link. Each budget is planned "as many as fit" (`plan.make_plan`: the most
bytes resident) and "by time" (`residency.by_time`: the residency with the shortest predicted
call), and each plan's steady call is predicted with prefetch (`timeline.predict`: a streamed
segment waits for the part of its copy that the compute before it did not hide). Cells: predicted
seconds per call (× the resident time). "refused (needs X)": the smallest budget that plans.
Links: {links} of host-to-device copy (assumed rates of pinned copies, not measured).
Predictions are the model's: the copy engines' contention with compute, allocator effects and
kernel-launch gaps are not in it.
"""


TIERS = """## VRAM and RAM budgets: blocks read from disk (predicted)

Under `max_ram_gb` each block's host copy is on the GPU (resident: read from the file once), in
RAM (a flat copy, streamed over the link) or read from disk at every call (through the 128 MiB
page-locked bounce buffer). Planned by time on PCIe 4.0 x16 (`residency.by_time`), the host tiers
under the RAM budget by `tiers.choose` (every weight read from the checkpoint itself), the reads
at an NVMe drive's stated sequential rate. The call with reads is the timeline's
(`timeline.predict` with the reads, a steady call in a session): the reader reads a group when
its slot frees, beside the compute of the groups before it, piece by piece through the bounce
buffer, and issues each piece's copy as it is read (checked against the executor on the
simulated accelerator, not measured on a GPU). The tiers are chosen once, not again for each
drive's rate. The RAM budget is per model; the page cache is not counted. Cells:
resident bytes, bytes in RAM (the flat copies of streamed blocks), bytes read from disk per call,
the call without reads, and with them at each drive's rate. Where the RAM budget leaves room, the
resident blocks' host copies are kept in RAM too (`Tiers.held`, not in the column), so a call
outside a session reads nothing from disk for them. The engine, which knows its disk's rate,
searches the residency with the reads of the tiers it gets (`joint.fastest`): under the model
never slower than these cells, which show the residency chosen without the reads.
"""


def document(time_part: list[str], notes: list[str], place_part: list[str], host: str,
             tier_part: list[str] = ()) -> str:
    cols = " | ".join(f"{link}: {kind} (predicted)" for link, _ in LINKS for kind in ("as many as fit", "by time"))
    links = " and ".join(f"{link} at {bps / 1e9:g} GB/s" for link, bps in LINKS)
    out = [HEADER.format(host=host, links=links),
           f"| model | budget | resident (predicted) | {cols} |", "|---|---|---|" + "---|" * (2 * len(LINKS)),
           *time_part, "", "Resident times per call, and where they come from:", "", *notes, "",
           "## Two GPUs against one",
           "",
           "Host-link bytes per call: the weights copied from host memory each call (`Placement."
           "host_bytes_per_forward`); hops: the device boundaries a call crosses; hop bytes: the "
           "activations that cross them (the first unit's entry bytes on the next device: the "
           "residual stream and the context). Placed by `placement.place` (fewest host-link bytes, "
           "then fewest hops, then fewest hop bytes); one GPU is `plan.make_plan`'s plan. \"traced\": "
           "the activations at the model's shape are in the budgets; \"weights only\": the dry run "
           "did not run, activations not counted.",
           "",
           "| model | GPUs | host-link bytes per call | hops | hop bytes per call | figures |",
           "|---|---|---|---|---|---|", *place_part, "", TIERS,
           "| model | VRAM / RAM | resident | in RAM | read from disk per call | call, no reads (predicted) | "
           + " | ".join(f"call at {d} (predicted)" for d, _ in DISKS) + " |",
           "|---|---|---|---|---|---|" + "---|" * len(DISKS), *tier_part]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    import docgen
    import full_size as fs
    from vramcut_core.planning.plan import PlanOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="one model (a substring of its name)")
    a = ap.parse_args(argv)
    fs.import_host()
    t0 = time.perf_counter()
    options = PlanOptions()
    pub = {p.model: p for p in PUBLISHED}
    time_part, notes, place_part, tier_part = [], [], [], []
    for spec in fs.MODELS:
        if a.only and a.only.lower() not in spec.name.lower():
            continue
        units, traced, split, meas, reason = dry_run(spec)
        place_part += placement_rows(spec.name, units, options, traced, split_unit=split)
        p = pub.get(spec.name)
        if p is None or meas is None:
            why = NOT_FOUND.get(spec.name, "no published step time found") if meas is not None \
                else f"not traced ({reason}): no FLOPs"
            notes.append(f"- **{spec.name}**: {why}; no time rows.")
            continue
        scale = 1.0
        if p.inputs is not None:
            _, _, _, at_pub, why = dry_run(spec, p.inputs)
            if at_pub is None:
                notes.append(f"- **{spec.name}**: the published shape could not be traced ({why}); no time rows.")
                continue
            scale = total_flops(meas) / total_flops(at_pub)
        timed = timed_units(units, meas, p.per_call_s, scale)
        time_part += time_rows(spec.name, timed, options, split_unit=split)
        tier_part += tier_rows(spec.name, timed, options, split_unit=split)
        scaled = f"; × {scale:.3f} (dry-run FLOPs at {spec.shape} over {p.shape}) = {secs(p.per_call_s * scale)} " \
                 f"per call" if p.inputs is not None else ""
        notes.append(f"- **{spec.name}** ({spec.shape}): {secs(p.per_call_s)} per call{scaled}. Source: {p.source}: "
                     f"{p.note}.")
        print(f"{spec.name}: done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    host, _ = fs.host_and_attention()
    print(document(time_part, notes, place_part, host, tier_part))
    print(docgen.stamp("COMFYUI_PATH=... python bench/predict_table.py > docs/predicted.md",
                       f"The page took {time.perf_counter() - t0:.0f} s."))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
