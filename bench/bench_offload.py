"""VRAMCut against what users would otherwise use, on one model and one input, in one run.

Rows, each a forward of the same seeded transformer on the same tokens:

* the plain model (every weight on the device);
* VRAMCut at 75%, 50% and 25% of the weights, and at 50% without prefetch and without residency;
* ComfyUI's own low-VRAM partial loading at the same weight budgets (``ModelPatcher.patch_model``
  with ``lowvram_model_memory``: what does not fit stays on the host and is cast per forward),
  when a ComfyUI host is importable from ``COMFYUI_PATH`` (on CPU with ``args.cpu``); the model's
  layers are then ComfyUI's own ``comfy.ops`` layers in every row, so all rows run one model;
* a block swap at the same budgets, as the popular block-swap nodes do it: the first N blocks
  resident (as many as fit beside one swapped block and the rest of the model), every other block
  copied in before its call and dropped after it, synchronously, no prefetch;
* on CUDA with a dynamic-VRAM host (comfy-aimdo), the host's own dynamic offloading
  (``ModelPatcherDynamic``, no budget: it uses what is free), in a fresh process.

Per row: time per forward, transfers per forward (VRAMCut: streamed segments, read from the
report's ``transfers_per_forward`` when it has one; ComfyUI: modules cast from the host; block
swap: blocks copied), bytes streamed per forward, peak allocated and reserved device memory over
the row (weights included; CUDA only: "n/a on CPU"), weights kept on the device between forwards,
and whether the output equals the plain model's.

    python bench/bench_offload.py --short                 # seconds on CPU (what CI runs)
    python bench/bench_offload.py --device cpu --small    # the mechanics' overhead on CPU
    python bench/bench_offload.py --device cuda --json bench/results/gpu.local.json

On CPU the "device" is host memory: the numbers show each method's own overhead (hooks, pointer
swaps, casts, copies), not PCIe behaviour.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NA_CPU = "n/a on CPU"
SHARES = (0.75, 0.5, 0.25)
ABLATION_SHARE = 0.5
MODELS = {  # DemoTransformer sizes and token counts
    "short": (dict(d=256, depth=8, heads=4, vocab=2048), 64),
    "small": (dict(d=1024, depth=8, heads=16, vocab=8192), 256),
    "large": (dict(d=3072, depth=24, heads=24, vocab=32000), 4096),
}


# -- the ComfyUI host ---------------------------------------------------------------------------

def import_host(device):
    """``(comfy, None)`` with ``comfy.model_management``/``model_patcher``/``ops`` imported from
    ``COMFYUI_PATH``, or ``(None, why not)``. On CPU the host is told ``args.cpu`` first."""
    path = os.environ.get("COMFYUI_PATH")
    if not path or not os.path.isfile(os.path.join(path, "comfy", "model_management.py")):
        return None, "not run: no ComfyUI host (set COMFYUI_PATH)"
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        from comfy.cli_args import args
        if device.type == "cpu" and "comfy.model_management" not in sys.modules:
            args.cpu = True
        import comfy.model_management
        import comfy.model_patcher
        import comfy.ops
    except Exception as e:  # a host that does not import here is a row not run, not a crash
        return None, f"not run: ComfyUI at {path} does not import ({type(e).__name__}: {e})"
    return comfy, None


def use_host_ops(model, comfy) -> None:
    """Make the model's layers ComfyUI's own (``comfy.ops.disable_weight_init``), in place: the
    same tensors, the host's forward (plain unless the host marks a layer to be cast)."""
    import torch

    ops = comfy.ops.disable_weight_init
    for m in model.modules():
        for base, host in ((torch.nn.Linear, ops.Linear), (torch.nn.LayerNorm, ops.LayerNorm),
                           (torch.nn.Embedding, ops.Embedding)):
            if type(m) is base:
                m.__class__ = host
                if host is ops.Embedding:
                    m.bias = None  # the host's embedding casts (weight, bias)
                break


# -- measuring ----------------------------------------------------------------------------------

class Peak:
    """Peak allocated and reserved device bytes over a ``with`` block, from the block's start
    (so weights moved in inside it count). On CPU both are ``NA_CPU``."""

    def __init__(self, dev) -> None:
        self.dev = dev
        self.allocated = self.reserved = NA_CPU

    def __enter__(self):
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.empty_cache()
            self._a = torch.cuda.memory_allocated(self.dev)
            self._r = torch.cuda.memory_reserved(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        return self

    def __exit__(self, *exc):
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            self.allocated = torch.cuda.max_memory_allocated(self.dev) - self._a
            self.reserved = torch.cuda.max_memory_reserved(self.dev) - self._r
        return False


def timed(fn, dev, repeat: int):
    """``(output of the last call, seconds per call)`` after one untimed warm-up call (VRAMCut's
    measured forward; ComfyUI's first casts). The median of the calls: a shared host's noise
    lands in a few of them."""
    import statistics

    import torch

    fn()
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def row(run: str, **kw) -> dict:
    r = {"run": run, "status": "ok", "budget_bytes": None, "time_s": None, "transfers": None,
         "bytes_streamed": None, "peak_allocated_bytes": None, "peak_reserved_bytes": None,
         "resident_bytes": None, "max_abs_diff": None, "equal": None}
    r.update(kw)
    return r


def compare(out, ref) -> dict:
    import torch

    out = out.float().cpu()
    return {"max_abs_diff": (out - ref).abs().max().item(), "equal": bool(torch.equal(out, ref))}


def fresh_copy(model):
    """A copy for a row that changes the model in place (normal tensors, not inference tensors,
    as a loader would have made them)."""
    import torch

    with torch.inference_mode(False):
        return copy.deepcopy(model)


# -- the rows -----------------------------------------------------------------------------------

def plan_transfers(plan) -> int:
    """Transfers per forward from the report (``transfers_per_forward``, when the report has it),
    else counted from the plan: each streamed segment a forward enters is one copy per pass."""
    from vramcut_core.planning.report import plan_to_json

    pj = plan_to_json(plan)
    if "transfers_per_forward" in pj:
        return int(pj["transfers_per_forward"])
    n = 0
    for s in plan.segments:
        entered = [plan.units[i] for i in s.units if plan.units[i].entered]
        if not s.resident and entered:
            n += max(u.calls for u in entered)
    return n


def run_plain(model, ids, dev, repeat, ref=None) -> tuple[dict, object]:
    with Peak(dev) as pk:
        model.to(dev)
        out, t = timed(lambda: model(ids), dev, repeat)
        out = out.float().cpu()
        model.to("cpu")
    w = nbytes(list(model.parameters()) + list(model.buffers()))
    return row("plain (all weights on the device)", time_s=t, transfers=0, bytes_streamed=0,
               peak_allocated_bytes=pk.allocated, peak_reserved_bytes=pk.reserved, resident_bytes=w,
               max_abs_diff=0.0, equal=True), out


def run_vramcut(model, ids, dev, repeat, ref, budget, prefetch=True, residency=True, tag="") -> dict:
    from vramcut_core import Engine, EngineConfig

    with Peak(dev) as pk:
        eng = Engine(model, EngineConfig(budget_bytes=budget, device=str(dev), prefetch=prefetch,
                                         residency=residency))
        with eng.session():
            out, t = timed(lambda: eng.run(model, ids), dev, repeat)
        st, plan = eng.last_stats, eng.last_plan
    return row(f"VRAMCut{tag}", budget_bytes=budget, time_s=t, transfers=plan_transfers(plan),
               bytes_streamed=st.bytes_streamed, peak_allocated_bytes=pk.allocated,
               peak_reserved_bytes=pk.reserved, resident_bytes=plan.resident_bytes,
               copies_measured=st.copies, device_weight_peak_bytes=st.peak_weight_bytes,
               plan_peak_bytes=plan.peak_bytes, **compare(out, ref))


def run_comfy_lowvram(model, ids, dev, repeat, ref, budget, comfy) -> dict:
    """The host's partial load at ``budget`` weight bytes: the modules that do not fit keep their
    weights on the host and are cast to the device on every forward."""
    import torch

    m = fresh_copy(model)
    with Peak(dev) as pk:
        patcher = comfy.model_patcher.ModelPatcher(m, load_device=dev, offload_device=torch.device("cpu"))
        patcher.patch_model(device_to=dev, lowvram_model_memory=budget)
        try:
            cast = [x for x in m.modules() if getattr(x, "comfy_cast_weights", False)]
            streamed = nbytes(p for x in cast for p in x.parameters(recurse=False))
            resident = patcher.loaded_size()
            out, t = timed(lambda: m(ids), dev, repeat)
        finally:
            patcher.unpatch_model(device_to=torch.device("cpu"))
    return row("ComfyUI low-VRAM partial load", budget_bytes=budget, time_s=t, transfers=len(cast),
               bytes_streamed=streamed, peak_allocated_bytes=pk.allocated, peak_reserved_bytes=pk.reserved,
               resident_bytes=resident, note="transfers and bytes: the modules the host left to cast per "
               "forward" + (" (on CPU the cast copies nothing: host and device are one)" if dev.type == "cpu" else ""),
               **compare(out, ref))


def run_block_swap(model, ids, dev, repeat, ref, budget) -> dict:
    """First N blocks resident, the others copied in before their call and dropped after it."""
    import torch

    m = fresh_copy(model)
    blocks = list(m.blocks)
    sizes = [nbytes(b.parameters()) for b in blocks]
    rest = nbytes(m.parameters()) - sum(sizes)
    n = 0
    while n < len(blocks) and rest + sum(sizes[:n + 1]) + (max(sizes[n + 1:], default=0)) <= budget:
        n += 1
    name = "block swap"
    if n < len(blocks) and rest + max(sizes[n:]) > budget:
        return row(name, budget_bytes=budget, status="not run: the budget is below one block and the "
                   "rest of the model")
    swapped = blocks[n:]
    count = {"transfers": 0, "bytes": 0}
    # the host copy a swapped block is copied from: pinned on CUDA (the nodes' pinned option)
    masters = {id(p): (p.pin_memory() if dev.type == "cuda" else p.data) for b in swapped for p in b.parameters()}
    originals = {p: p.data for p in m.parameters()}

    def pre(blk, _args):
        count["transfers"] += 1
        for p in blk.parameters():
            src = masters[id(p)]
            p.data = src.to(dev, non_blocking=True, copy=True)
            count["bytes"] += src.numel() * src.element_size()

    def post(blk, _args, _out):
        for p in blk.parameters():
            p.data = masters[id(p)]

    hooks = []
    with Peak(dev) as pk:
        try:
            for b in blocks[:n]:
                for p in b.parameters():
                    p.data = p.data.to(dev)
            for mod in (x for x in m.children() if x is not m.blocks):
                for p in mod.parameters():
                    p.data = p.data.to(dev)
            for b in swapped:
                for p in b.parameters():
                    p.data = masters[id(p)]
                hooks += [b.register_forward_pre_hook(pre), b.register_forward_hook(post)]
            out, t = timed(lambda: m(ids), dev, repeat)
        finally:
            for h in hooks:
                h.remove()
            for p, d in originals.items():
                p.data = d
    calls = repeat + 1  # timed() runs one more, untimed
    return row(f"{name} ({n} of {len(blocks)} blocks resident)", budget_bytes=budget, time_s=t,
               transfers=count["transfers"] // calls, bytes_streamed=count["bytes"] // calls,
               peak_allocated_bytes=pk.allocated, peak_reserved_bytes=pk.reserved,
               resident_bytes=rest + sum(sizes[:n]), **compare(out, ref))


def run_dynamic(dev, size: str, dtype: str, repeat: int, ref, comfy) -> dict:
    """The host's dynamic offloading (comfy-aimdo), in a fresh process: the allocator it installs
    must be set up before CUDA is first used."""
    name = "ComfyUI dynamic VRAM (no budget)"
    if dev.type != "cuda":
        return row(name, status="not run: needs CUDA")
    if comfy is None:
        return row(name, status="not run: no ComfyUI host (set COMFYUI_PATH)")
    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        return row(name, status="not run: the host has no dynamic VRAM (no ModelPatcherDynamic)")
    import torch

    with tempfile.TemporaryDirectory() as d:
        ref_path = os.path.join(d, "ref.pt")
        torch.save(ref, ref_path)
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-dynamic", ref_path,
                            "--size", size, "--dtype", dtype, "--repeat", str(repeat)],
                           capture_output=True, text=True, timeout=600)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return row(name, status=f"failed: {p.stderr.strip()[-500:]}")


def child_dynamic(ref_path: str, size: str, dtype: str, repeat: int) -> dict:
    """Set the host up as its ``main.py`` does for dynamic VRAM, then load and run the model
    through ``ModelPatcherDynamic`` and ``load_models_gpu``."""
    name = "ComfyUI dynamic VRAM (no budget)"
    try:
        import comfy_aimdo.control
        if not comfy_aimdo.control.init():
            return row(name, status="not run: comfy-aimdo does not load here")
        import torch
        dev = torch.device("cuda")
        comfy, why = import_host(dev)
        if comfy is None:
            return row(name, status=why)
        import comfy.memory_management
        ids_dev = [d.index for d in comfy.model_management.get_all_torch_devices()]
        if not comfy_aimdo.control.init_devices(ids_dev):
            return row(name, status="not run: comfy-aimdo found no device it supports")
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
        model, ids = build_model(size, dtype, dev, comfy)
        ref = torch.load(ref_path)
        with torch.inference_mode(), Peak(dev) as pk:
            patcher = comfy.model_patcher.ModelPatcherDynamic(model, dev, torch.device("cpu"))
            comfy.model_management.load_models_gpu([patcher])
            out, t = timed(lambda: model(ids), dev, repeat)
            resident = patcher.loaded_size()
        return row(name, time_s=t, transfers="not counted", bytes_streamed="not counted",
                   peak_allocated_bytes=pk.allocated, peak_reserved_bytes=pk.reserved,
                   resident_bytes=resident, note="peaks from torch's allocator; the weights the host "
                   "faults into its own virtual ranges (comfy-aimdo) may lie outside it", **compare(out, ref))
    except Exception as e:
        return row(name, status=f"failed: {type(e).__name__}: {e}"[:500])


# -- the run ------------------------------------------------------------------------------------

def build_model(size: str, dtype: str, dev, comfy=None):
    import torch

    from vramcut_core.cli.demo import build

    kw, tokens = MODELS[size]
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = build(0, **kw).to(dt)
    if comfy is not None:
        use_host_ops(model, comfy)
    ids = torch.randint(0, kw["vocab"], (1, tokens), generator=torch.Generator().manual_seed(0)).to(dev)
    return model, ids


def run(device: str, size: str, dtype: str, repeat: int, host: bool = True) -> dict:
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        dtype = "fp32"  # CPU matmuls in half precision are slow and not what a GPU runs
    comfy, why = import_host(dev) if host else (None, "not run: --no-host")
    model, ids = build_model(size, dtype, dev, comfy)
    weights = nbytes(list(model.parameters()) + list(model.buffers()))
    rows = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        plain, ref = run_plain(model, ids, dev, repeat)
        rows.append(plain)
        for share in SHARES:
            budget = int(weights * share)
            tag = f" {share:.0%} of weights"
            rows.append(run_vramcut(model, ids, dev, repeat, ref, budget, tag=tag))
            if share == ABLATION_SHARE:
                rows.append(run_vramcut(model, ids, dev, repeat, ref, budget, prefetch=False,
                                        tag=tag + ", no prefetch"))
                rows.append(run_vramcut(model, ids, dev, repeat, ref, budget, residency=False,
                                        tag=tag + ", no residency"))
            if comfy is not None:
                r = run_comfy_lowvram(model, ids, dev, repeat, ref, budget, comfy)
            else:
                r = row("ComfyUI low-VRAM partial load", budget_bytes=budget, status=why)
            r["run"] += tag
            rows.append(r)
            r = run_block_swap(model, ids, dev, repeat, ref, budget)
            r["run"] += tag
            rows.append(r)
    rows.append(run_dynamic(dev, size, dtype, repeat, ref, comfy))
    host_version = None
    if comfy is not None:
        try:
            import comfyui_version
            host_version = comfyui_version.__version__
        except ImportError:
            host_version = "unknown"
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "comfyui": host_version, "model": size,
            "model_weight_bytes": weights, "tokens": ids.shape[1], "dtype": dtype, "repeat": repeat,
            "elapsed_s": time.perf_counter() - t0, "rows": rows}


def fmt(v, kind: str) -> str:
    from vramcut_core.model.tensors import fmt_bytes

    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if kind == "ms":
        return f"{v * 1e3:.2f}"
    if kind == "bytes":
        return fmt_bytes(v)
    if kind == "eq":
        return "yes" if v else "no"
    return str(v)


def format_table(res: dict) -> str:
    from vramcut_core.model.tensors import fmt_bytes

    cols = (("run", "run", ""), ("ms/forward", "time_s", "ms"), ("transfers", "transfers", ""),
            ("streamed", "bytes_streamed", "bytes"), ("peak alloc", "peak_allocated_bytes", "bytes"),
            ("peak reserved", "peak_reserved_bytes", "bytes"), ("resident", "resident_bytes", "bytes"),
            ("= plain", "equal", "eq"))
    lines = [f"{res['device']} · model {fmt_bytes(res['model_weight_bytes'])} {res['dtype']} · "
             f"{res['tokens']} tokens · torch {res['torch']} · ComfyUI {res['comfyui'] or 'not imported'} · "
             f"median of {res['repeat']} forwards after one warm-up"]
    table = []
    for r in res["rows"]:
        if r["status"] != "ok":
            table.append([r["run"], r["status"]])
            continue
        table.append([fmt(r[k], kind) if k != "run" else r["run"] for _, k, kind in cols])
    widths = [max(len(c[0]), *(len(t[i]) for t in table if len(t) == len(cols))) for i, c in enumerate(cols)]
    lines.append("  ".join(c[0].ljust(w) if i == 0 else c[0].rjust(w) for i, (c, w) in enumerate(zip(cols, widths))))
    for t in table:
        if len(t) != len(cols):
            lines.append(f"{t[0].ljust(widths[0])}  {t[1]}")
        else:
            lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(t, widths))))
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--short", action="store_true", help="a tiny model: seconds on CPU (CI)")
    ap.add_argument("--small", action="store_true", help="a 448 MiB model (CPU runs)")
    ap.add_argument("--size", choices=tuple(MODELS), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--repeat", type=int, default=None, help="timed forwards per row (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch on CPU (default 1: steadier "
                    "figures on a shared machine)")
    ap.add_argument("--no-host", action="store_true", help="leave the ComfyUI rows out even with COMFYUI_PATH set")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child-dynamic", metavar="REF", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    size = a.size or ("short" if a.short else "small" if a.small else "large")
    repeat = a.repeat or 5
    if a.child_dynamic:
        print(json.dumps(child_dynamic(a.child_dynamic, size, a.dtype, repeat)))
        return 0
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    res = run(a.device, size, a.dtype, repeat, host=not a.no_host)
    res["threads"] = torch.get_num_threads()
    print(format_table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
