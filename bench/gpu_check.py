"""One-shot check of the CUDA path on a real GPU (under 8 minutes on one GPU); prints JSON.

What the simulated accelerator in the tests cannot tell:

* ``register``: cudaHostRegister / cudaHostUnregister cost per GB; whether a failed registration
  leaves a pending CUDA error, and whether the executor's clearing removes it;
* ``bandwidth``: pinned host-to-device bandwidth;
* ``sanitizer``: the toys and a Flux-shaped model under ``TORCH_CUDA_SANITIZER=1``, with the
  native caching allocator and with ``cudaMallocAsync`` (one subprocess each): bit-equal to the
  plain forward, no sanitizer report;
* ``forwards``: ``max_memory_reserved`` over whole forwards (plan switches included) against the
  budget; per-forward time against max(compute-only time, streamed bytes / pinned bandwidth);
* ``sessions``: first-forward cost, host RSS and page-locked bytes across sessions;
* ``offload``: ``bench_offload.py``'s comparison (plain, VRAMCut at three budgets and without
  prefetch/residency, ComfyUI's low-VRAM partial load and a block swap at the same budgets, the
  host's dynamic VRAM when ``COMFYUI_PATH`` names a host that has it);
* ``checks`` (first, a few seconds each): what the engine promises, one check each, in
  ``bench/gpu_engine_checks.py`` (its docstring lists them).

Every check that runs an engine (and ``forwards``) adds ``time_per_call``, the plan's predicted
seconds per call against the measured ones (``bench/gpu_timing.py``). The host-to-device bandwidth
the engine plans with is measured first (``bandwidth.host_to_device``), as the node does at load.

``--dry`` runs on CPU: imports everything and prints the same keys, every figure null or
"not measured". Nothing here is a figure until it has run on a GPU.

    python bench/gpu_check.py [--dry] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import gpu_common  # noqa: F401  (puts the checkout on the import path)
import torch  # noqa: E402

import toys  # noqa: E402
from gpu_common import weight_bytes  # noqa: E402
from gpu_engine_checks import CHECKS, round2  # noqa: E402
from gpu_timing import time_per_call, time_text  # noqa: E402
from vramcut_core import Engine, EngineConfig  # noqa: E402
from vramcut_core.figures import bandwidth  # noqa: E402
from vramcut_core.runtime import host_memory as ex  # noqa: E402

NOT = "not measured"
GB = 1 << 30
ALLOCATORS = {"native": "", "cudaMallocAsync": "backend:cudaMallocAsync"}
MODELS = ("transformer", "unet", "subclass", "flux_shaped")


def _rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def models(quick: bool):
    """(name, model, inputs) in the dtype a GPU runs them in."""
    g = torch.Generator().manual_seed(0)
    out = [
        ("transformer", toys.seeded(toys.TransformerStack(d=256, depth=12)), (torch.randint(0, 50, (2, 64), generator=g),)),
        ("unet", toys.seeded(toys.UNetLike(ch=64)), (torch.randn(2, 4, 32, 32, generator=g), torch.rand(2, generator=g))),
        ("subclass", toys.QuantStack(d=256, depth=8).eval(), (torch.randn(8, 256, generator=g),)),
    ]
    d, nd, ns = (512, 4, 8) if quick else (1536, 19, 38)   # Flux: 19 double and 38 single blocks
    flux = toys.seeded(toys.FluxLike(d=d, n_double=nd, n_single=ns)).to(torch.bfloat16)
    out.append(("flux_shaped", flux, (torch.randn(1, 1024, 16, generator=g, dtype=torch.bfloat16),
                                      torch.rand(1, generator=g, dtype=torch.bfloat16))))
    return out


# -- measurements (GPU) -----------------------------------------------------------------------

def _runs(dev) -> bool:
    """Does a kernel run on ``dev`` (no CUDA error left pending by an earlier runtime call)?"""
    try:
        torch.ones(1, device=dev).add_(1)
        torch.cuda.synchronize(dev)
        return True
    except RuntimeError:
        return False


def check_register(dev) -> dict:
    n = 1 * GB
    buf = torch.empty(n, dtype=torch.uint8)
    buf.fill_(1)
    rt = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = rt.cudaHostRegister(buf.data_ptr(), n, ex._HOST_REGISTER_PORTABLE)
    t1 = time.perf_counter()
    ok = int(getattr(err, "value", err)) == 0
    rt.cudaHostUnregister(buf.data_ptr()) if ok else None
    t2 = time.perf_counter()
    # a registration that must fail: the same range twice
    rt.cudaHostRegister(buf.data_ptr(), n, 0)
    second = rt.cudaHostRegister(buf.data_ptr(), n, 0)
    failed = int(getattr(second, "value", second)) != 0
    pending = cleared = None
    if failed:
        pending = not _runs(dev)
        # the executor's clearing, after a second failure
        rt.cudaHostRegister(buf.data_ptr(), n, 0)
        ex._clear_cuda_error(dev)
        cleared = _runs(dev)
    rt.cudaHostUnregister(buf.data_ptr())
    ex._clear_cuda_error(dev)
    return {"registered": ok, "register_s_per_gb": (t1 - t0) if ok else None,
            "unregister_s_per_gb": (t2 - t1) if ok else None,
            "failed_register_leaves_pending_error": pending, "executor_clears_it": cleared}


def pinned_bandwidth(dev) -> float:
    n = 512 << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    b.record()
    b.synchronize()
    return 5 * n / (a.elapsed_time(b) / 1e3) / 1e9


def run_forwards(name, model, args, dev, bw_gbps, n=4) -> dict:
    """Whole forwards under a budget of 40% of the weights (plus room for activations)."""
    model = model.to("cpu")
    dargs = tuple(a.to(dev) for a in args)
    with torch.no_grad():
        ref = model.to(dev)(*dargs).float().cpu()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            model(*dargs)
        torch.cuda.synchronize(dev)
        compute = (time.perf_counter() - t0) / n
        model.to("cpu")
        torch.cuda.empty_cache()
        w = weight_bytes(model)
        budget = int(w * 0.4) + (256 << 20)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device=str(dev)))
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_reserved(dev)
        times, outs, firsts = [], [], None
        with eng.session():
            for i in range(n + 2):
                t = time.perf_counter()
                outs.append(eng.run(model, *dargs).float().cpu())
                torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t)
                if i == 0:
                    firsts = times[0]
                if i == 1:
                    eng.reset_stats()  # the engine's own time: the steady forwards below only
        peak = torch.cuda.max_memory_reserved(dev) - base
        steady = sum(times[2:]) / len(times[2:])
        streamed = eng.last_plan.streamed_bytes_per_forward
        floor = max(compute, streamed / (bw_gbps * 1e9)) if bw_gbps else None
        return {"weight_bytes": w, "budget_bytes": budget, "max_reserved_bytes": peak,
                "within_budget": peak <= budget, "bit_equal": all(torch.equal(o, ref) for o in outs),
                "first_forward_s": firsts, "forward_s": steady, "compute_only_s": compute,
                "streamed_bytes": streamed, "floor_s": floor,
                "over_floor": (steady / floor) if floor else None, "time_per_call": time_per_call(eng)}


def sessions(dev) -> dict:
    model = toys.seeded(toys.TransformerStack(d=1024, depth=16))
    x = torch.randint(0, 50, (2, 256)).to(dev)
    out = []
    with torch.no_grad():
        eng = Engine(model, EngineConfig(budget_bytes=int(weight_bytes(model) * 0.4) + (128 << 20), device=str(dev)))
        for _ in range(3):
            t = time.perf_counter()
            with eng.session():
                eng.run(model, x)
                torch.cuda.synchronize(dev)
                first = time.perf_counter() - t
                eng.run(model, x)
            out.append({"first_forward_s": first, "rss_bytes": _rss(), "page_locked_bytes": ex.PAGE_LOCKED.bytes})
        del eng
    return {"sessions": out, "page_locked_after_drop_bytes": ex.PAGE_LOCKED.bytes}


def child(quick: bool) -> dict:
    """Runs in a subprocess (sanitizer and allocator set by the parent's environment)."""
    dev = torch.device("cuda")
    res = {}
    for name, model, args in models(quick):
        try:
            r = run_forwards(name, model, args, dev, None, n=2)
            res[name] = {"ok": r["bit_equal"] and r["within_budget"], "bit_equal": r["bit_equal"],
                         "within_budget": r["within_budget"], "error": None}
        except Exception as e:  # the sanitizer reports a race by raising
            res[name] = {"ok": False, "bit_equal": None, "within_budget": None, "error": f"{type(e).__name__}: {e}"[:500]}
    return res


def sanitizer(quick: bool, timeout: int) -> dict:
    out = {}
    for alloc, conf in ALLOCATORS.items():
        env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        try:
            p = subprocess.run([sys.executable, __file__, "--child"] + (["--quick"] if quick else []),
                               env=env, capture_output=True, text=True, timeout=timeout)
            out[alloc] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else \
                {"error": p.stderr[-2000:]}
        except Exception as e:
            out[alloc] = {"error": f"{type(e).__name__}: {e}"}
    return out


def offload(quick: bool) -> dict:
    """The comparison with what users would otherwise use (``bench_offload.py``)."""
    import bench_offload

    try:
        return bench_offload.run("cuda", "small" if quick else "large", "bf16", repeat=3)
    except Exception as e:
        return {"rows": None, "error": f"{type(e).__name__}: {e}"[:1000]}


# -- the report -------------------------------------------------------------------------------

def report(dry: bool, quick: bool) -> dict:
    names = list(MODELS)
    if dry or not torch.cuda.is_available():
        forward = {k: NOT for k in ("weight_bytes", "budget_bytes", "max_reserved_bytes", "within_budget",
                                    "bit_equal", "first_forward_s", "forward_s", "compute_only_s",
                                    "streamed_bytes", "floor_s", "over_floor", "time_per_call")}
        return {
            "dry": True, "device": None, "torch": torch.__version__,
            "register": {k: NOT for k in ("registered", "register_s_per_gb", "unregister_s_per_gb",
                                          "failed_register_leaves_pending_error", "executor_clears_it")},
            "bandwidth": {"pinned_h2d_gbps": NOT, "engine_h2d_bytes_per_s": NOT, "engine_copy_latency_s": NOT,
                          "engine_h2d_source": NOT},
            "sanitizer": {a: {n: NOT for n in names} for a in ALLOCATORS},
            "forwards": {n: dict(forward) for n in names},
            "sessions": {"sessions": NOT, "page_locked_after_drop_bytes": NOT},
            "offload": {"rows": NOT},
            "checks": {c: {"ok": NOT, "time_per_call": NOT} for c in CHECKS},
        }
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    res = {"dry": False, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    # the figure the engines plan by time with (cached for the checks run in fresh processes)
    engine_bw = bandwidth.host_to_device(dev)
    res["checks"] = round2(dev)
    res["register"] = check_register(dev)
    bw = pinned_bandwidth(dev)
    res["bandwidth"] = {"pinned_h2d_gbps": bw, "engine_h2d_bytes_per_s": engine_bw["bytes_per_s"],
                        "engine_copy_latency_s": engine_bw.get("latency_s"), "engine_h2d_source": engine_bw["source"]}
    res["forwards"] = {}
    for n, m, a in models(quick):
        res["forwards"][n] = r = run_forwards(n, m, a, dev, bw)
        print(f"forwards {n}: time per call: {time_text(r['time_per_call'])}", file=sys.stderr, flush=True)
    res["sessions"] = sessions(dev)
    res["offload"] = offload(quick)
    res["sanitizer"] = sanitizer(quick, timeout=100)
    res["elapsed_s"] = time.perf_counter() - t0
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU: import everything, print the keys, measure nothing")
    ap.add_argument("--quick", action="store_true", help="a smaller Flux-shaped model")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.quick)))
        return 0
    print(json.dumps(report(a.dry, a.quick), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
