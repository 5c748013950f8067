"""Segmented execution against the alternatives, on one model and one input.

Compares, per forward: the plain model (all weights on the device, when they fit), VRAMCut at
several budgets, VRAMCut with prefetch and residency off, and a naive block-swap offloader
(each block moved to the device and back around its call, synchronously; what "block swap"
nodes do without a byte budget). Reports time, measured peak device bytes and bytes streamed.

    python bench/bench_offload.py --device cuda --json bench/results/gpu.local.json
    python bench/bench_offload.py --device cpu --small      # the mechanics' overhead on CPU

On CPU the "device" is host memory, so the numbers show the executor's own overhead (hooks,
pointer swaps, copies), not PCIe behaviour.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from vramcut_core import Engine, EngineConfig, find_units
from vramcut_core.demo import build
from vramcut_core.tensors import fmt_bytes


def timed(fn, device, repeat):
    fn()  # warm-up (and, for VRAMCut, the measured forward)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = None
    return out, (time.perf_counter() - t0) / repeat, peak


def naive_block_swap(model, device):
    """Move each block to the device before its call and back after it, synchronously."""
    def pre(m, _):
        m.to(device)

    def post(m, _a, _o):
        m.to("cpu")

    hooks = []
    for b in model.blocks:
        hooks += [b.register_forward_pre_hook(pre), b.register_forward_hook(post)]
    for m in (model.embed, model.norm, model.head):
        m.to(device)
    return hooks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="a small model (CPU runs)")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    if dev.type == "cpu":
        dtype = torch.float32
    kw = dict(d=1024, depth=8, heads=16, vocab=8192) if a.small else dict(d=3072, depth=24, heads=24, vocab=32000)
    tokens = 256 if a.small else 4096
    model = build(0, **kw).to(dtype)
    weights = find_units(model).weight_bytes
    ids = torch.randint(0, kw["vocab"], (1, tokens), generator=torch.Generator().manual_seed(0)).to(dev)
    rows = []
    with torch.inference_mode():
        ref = None
        if dev.type == "cpu" or weights < torch.cuda.mem_get_info(dev)[0] * 0.8:
            model.to(dev)
            ref, t, peak = timed(lambda: model(ids), dev, a.repeat)
            rows.append({"run": "plain (all weights on device)", "time_s": t, "peak_bytes": peak, "streamed_bytes": 0})
            ref = ref.float().cpu()
            model.to("cpu")
        for share in (0.75, 0.5, 0.25):
            for prefetch, residency, tag in ((True, True, ""), (False, False, ", no prefetch/residency")):
                if tag and share != 0.5:
                    continue
                budget = int(weights * share)
                eng = Engine(model, EngineConfig(budget_bytes=budget, device=str(dev), prefetch=prefetch, residency=residency))
                with eng.session():
                    out, t, peak = timed(lambda: eng.run(model, ids), dev, a.repeat)
                    st = eng.last_stats
                diff = (out.float().cpu() - ref).abs().max().item() if ref is not None else None
                rows.append({"run": f"VRAMCut budget {share:.0%} of weights{tag}", "budget_bytes": budget,
                             "time_s": t, "peak_bytes": peak if peak is not None else st.peak_weight_bytes,
                             "streamed_bytes": st.bytes_streamed, "wait_s": st.time_wait_s,
                             "plan_peak_bytes": eng.last_plan.peak_bytes, "max_abs_diff": diff})
        hooks = naive_block_swap(model, dev)
        try:
            out, t, peak = timed(lambda: model(ids), dev, a.repeat)
        finally:
            for h in hooks:
                h.remove()
            model.to("cpu")
        rows.append({"run": "naive block swap (sync, no budget)", "time_s": t, "peak_bytes": peak,
                     "streamed_bytes": sum(p.numel() * p.element_size() for p in model.blocks.parameters())})
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "model_weight_bytes": weights, "tokens": tokens, "dtype": str(dtype),
            "rows": rows}
    print(f"{info['device']} · model {fmt_bytes(weights)} {dtype} · {tokens} tokens · torch {torch.__version__}")
    for r in rows:
        extra = f" diff {r['max_abs_diff']:.2g}" if r.get("max_abs_diff") is not None else ""
        print(f"{r['run']:46s} {r['time_s'] * 1e3:9.1f} ms  peak {fmt_bytes(r['peak_bytes']):>10s}  "
              f"streamed {fmt_bytes(r['streamed_bytes']):>10s}{extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
