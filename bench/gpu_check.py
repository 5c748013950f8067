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
  host's dynamic VRAM when ``COMFYUI_PATH`` names a host that has it).

* ``checks`` (first, a few seconds; one line each on stderr as it finishes):
  ``kitchen``: comfy-kitchen fp8 and nvfp4 weights streamed with prefetch, forwards 1..5
  bit-equal to the unpatched model, every weight part inside the executor's buffers;
  ``replan``: a budget a block's intra-module temporary overshoots while measuring: a finer cut,
  ``max_memory_reserved`` within the budget on every forward;
  ``outgrow``: a block's temporary grows mid-run with the same input shape (a longer prompt held
  by the host): the forward over the budget is seen, re-planned once, later forwards within it,
  no host sync and no ``empty_cache`` per steady step after;
  ``teardown``: weights held by a session, the host's release and move to the offload device
  while held: nothing left on the device, no parameter copied back, values unchanged;
  ``alternating``: two cached shapes in turn, host syncs (stream, event, device) and
  ``empty_cache`` calls counted per steady forward;
  ``second_gpu``: a model on ``cuda:1`` with ``cuda:0`` current (where two GPUs exist):
  bit-equal, nothing allocated on ``cuda:0``;
  ``compiler``: a Qwen-Image-2.1-shaped model under the host's model compiler (ComfyUI 0.38+
  named by ``COMFYUI_PATH``), in a fresh process: no recording begun while VRAMCut runs it, the
  same measured peaks as with the compiler off (``bench/gpu_compiler_check.py``; elsewhere
  "skipped: host has no compiler");
  ``file_backed``: a transformer mapped from a safetensors file (fast-disk loading) streamed with
  the mapped tensors as masters through the page-locked window, and from RAM with flat masters:
  bit-equal both ways, no flat master and no more page-locked than the window with it, the time
  per forward of each (``bench/gpu_file_backed_check.py``);
  ``detach``: a detach during sampling on a host that page-locks the offloaded weights itself
  (ComfyUI 0.33+ found as the tests find it), in a fresh process: the host detaches the patched
  model from inside a forward, then unloads every model: nothing of the model left page-locked by
  the host, no "Tried to unpin tensor not pinned by ComfyUI" warning, the next run bit-equal to
  the first (``bench/gpu_detach_check.py``; without such a host "skipped: ..." and why).

Every check that runs an engine (and ``forwards``) adds ``time_per_call``: the plan's predicted
seconds per call (``Plan.time``, the timeline model), the measured seconds per call (the engine's
steady forwards, timed on the compute stream) and the prediction's error, printed in its line as
"predicted 12.3 ms/call, measured 13.0 ms (-5 %)", or "no prediction (why)" where the engine made
none (residency by bytes, no bandwidth figure, several devices). The host-to-device bandwidth the
engine plans with is measured first (``bandwidth.host_to_device``), as the node does at load.

``--dry`` runs on CPU: imports everything and prints the same keys, every figure null or
"not measured". Nothing here is a figure until it has run on a GPU.

    python bench/gpu_check.py [--dry] [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "core")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

import gpu_compiler_check  # noqa: E402
import gpu_detach_check  # noqa: E402
import gpu_file_backed_check  # noqa: E402
import toys  # noqa: E402
from vramcut_core import Engine, EngineConfig  # noqa: E402
from vramcut_core.figures import bandwidth, speed  # noqa: E402
from vramcut_core.runtime import host_memory as ex  # noqa: E402

NOT = "not measured"
GB = 1 << 30
ALLOCATORS = {"native": "", "cudaMallocAsync": "backend:cudaMallocAsync"}
MODELS = ("transformer", "unet", "subclass", "flux_shaped")
CHECKS = ("kitchen", "replan", "outgrow", "teardown", "alternating", "second_gpu", "compiler", "file_backed",
          "detach", "devices")


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


def weight_bytes(m) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


# -- predicted against measured time per call ----------------------------------------------------

def _why_no_prediction(eng) -> str:
    """Why ``eng``'s plan carries no predicted time (``planner.timed``'s conditions)."""
    cfg = eng.config
    if len(cfg.devices or ()) > 1:
        return "several devices: the combined plan has no single predicted step"
    if not speed.by_time(cfg):
        return f"speed={cfg.speed} on {torch.device(cfg.device).type}: residency by bytes, no timeline"
    if not speed.Figures.bytes_per_s(cfg):
        return f"no host-to-device bandwidth figure for {cfg.device}"
    return "no compute time for every unit (no FLOP count or no throughput figure)"


def time_per_call(eng, plans=None) -> dict:
    """The plan's predicted seconds per call against the engine's measured steady seconds per call
    (``report.time_to_json``). ``plans``: the plans the timed calls ran in turn (shapes that
    alternate), predicted as their mean; by default the engine's last plan."""
    last = eng.last_plan
    j = {"predicted_s": last.time.predicted_s, "source": last.time.source} if last is not None and last.time else None
    measured = eng.steady_stats.s_per_forward if last is not None and last.measured else None
    if plans is not None:
        times = [p.time for p in plans]
        j = None if any(t is None for t in times) else {
            "predicted_s": sum(t.predicted_s for t in times) / len(times),
            "source": "+".join(sorted({t.source for t in times}))}
    if j is None:
        return {"predicted_s": None, "measured_s": measured, "error": None, "no_prediction": _why_no_prediction(eng)}
    return {"predicted_s": j["predicted_s"], "measured_s": measured, "source": j["source"],
            "error": (j["predicted_s"] - measured) / measured if measured else None}


def time_text(t: dict) -> str:
    """``time_per_call`` as one phrase: "predicted 12.3 ms/call, measured 13.0 ms (-5 %)"."""
    ms = lambda s: f"{s * 1e3:.3g} ms"  # noqa: E731
    meas = "not measured (no steady forward timed)" if t.get("measured_s") is None else f"measured {ms(t['measured_s'])}"
    if t.get("predicted_s") is None:
        return f"no prediction ({t.get('no_prediction')}), {meas}"
    err = f" ({t['error'] * 100:+.0f} %)" if t.get("error") is not None else ""
    return f"predicted {ms(t['predicted_s'])}/call, {meas}{err}"


def _times(res: dict, at: str = "") -> list[str]:
    """Every ``time_per_call`` in a check's result (its own, and its parts'), as phrases."""
    out = []
    for k, v in res.items():
        if k == "time_per_call" and isinstance(v, dict):
            out.append((f"{at}: " if at else "") + time_text(v))
        elif isinstance(v, dict):
            out.extend(_times(v, f"{at}.{k}" if at else k))
    return out


# -- measurements (GPU) -----------------------------------------------------------------------

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
    pending = None
    if failed:
        try:
            torch.ones(1, device=dev).add_(1)
            torch.cuda.synchronize(dev)
            pending = False
        except RuntimeError:
            pending = True
        # the executor's clearing, after a second failure
        rt.cudaHostRegister(buf.data_ptr(), n, 0)
        ex._clear_cuda_error(dev)
        try:
            torch.ones(1, device=dev).add_(1)
            torch.cuda.synchronize(dev)
            cleared = True
        except RuntimeError:
            cleared = False
    else:
        cleared = None
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


# -- round-2 checks: each returns {"ok": bool or None (not applicable), ...figures} ---------------

def _say(name: str, res: dict) -> dict:
    figures = ", ".join(f"{k}={v}" for k, v in _without_times(res).items() if k != "ok")
    times = "; ".join(_times(res))
    print(f"check {name}: {'ok' if res.get('ok') else ('n/a' if res.get('ok') is None else 'FAIL')}"
          + (f" ({figures})" if figures else "") + (f"; time per call: {times}" if times else ""),
          file=sys.stderr, flush=True)
    return res


def _without_times(res: dict) -> dict:
    return {k: _without_times(v) if isinstance(v, dict) else v for k, v in res.items() if k != "time_per_call"}


def _budget_to_stream(model, x, dev, share=0.5) -> int:
    """A budget that streams about half the weights (activations measured first)."""
    probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device=str(dev)))
    probe.run(model, *x)
    probe.release()
    p = probe.last_plan
    biggest = max(u.weight_bytes for u in p.units)
    return max(int(weight_bytes(model) * share), 3 * biggest) + p.activation_reserve_bytes


def check_kitchen(dev) -> dict:
    try:
        import kitchen_toys as kt
    except ImportError as e:
        return {"ok": None, "why": f"comfy_kitchen not importable: {e}"}
    res = {"ok": True}
    for layout in ("fp8", "nvfp4"):
        model = kt.KitchenStack(layout, d=1024, depth=8).to(dev)
        x = tuple(a.to(dev) for a in kt.inputs(batch=2, tokens=256))
        ref = model(*x)
        model.to("cpu")
        eng = Engine(model, EngineConfig(budget_bytes=_budget_to_stream(model, x, dev), device=str(dev)))
        outside, exact = [], []

        def look(mod, _a, _o):
            parts = kt.inner(mod.weight)
            if parts[0].is_cuda:
                home = parts[0].untyped_storage().data_ptr()
                outside.extend(p.untyped_storage().nbytes() for p in parts[1:]
                               if p.untyped_storage().data_ptr() != home)

        hs = [m.register_forward_hook(look) for m in model.modules() if isinstance(m, kt.KitchenLinear)]
        try:
            with eng.session():
                for i in range(5):
                    exact.append(torch.equal(eng.run(model, *x), ref))
                    if i == 1:
                        eng.reset_stats()  # time the steady forwards after
        finally:
            for h in hs:
                h.remove()
        ok = all(exact) and not outside and eng.last_plan.slots == 2
        res[layout] = {"bit_equal_per_forward": exact, "bytes_outside_buffers": sum(outside),
                       "time_per_call": time_per_call(eng)}
        res["ok"] = res["ok"] and ok
    return res


def check_replan(dev) -> dict:
    model = toys.seeded(toys.TempStack(d=1024, depth=8, k=64)).to(dev)
    x = (torch.randn(4, 256, 16, generator=torch.Generator().manual_seed(2)).to(dev),)
    ref = model(*x)
    model.to("cpu")
    torch.cuda.empty_cache()
    probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device=str(dev)))
    probe.run(model, *x)
    probe.release()
    block = max(u.weight_bytes for u in probe.last_plan.units)
    budget = probe.last_plan.activation_reserve_bytes + (block + 2 * block // 3) // 2
    eng = Engine(model, EngineConfig(budget_bytes=budget, device=str(dev)))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(dev)
    peaks, exact = [], []
    with eng.session():
        for i in range(4):
            torch.cuda.reset_peak_memory_stats(dev)
            exact.append(torch.equal(eng.run(model, *x), ref))
            peaks.append(torch.cuda.max_memory_reserved(dev) - base)
            if i == 1:
                eng.reset_stats()  # time the steady forwards after
    return {"ok": all(exact) and bool(eng.last_plan.split) and max(peaks) <= budget,
            "budget_bytes": budget, "reserved_peaks": peaks, "split": list(eng.last_plan.split)[:4],
            "bit_equal": all(exact), "time_per_call": time_per_call(eng)}


class _Prompt(torch.nn.Module):
    """A block attending to a prompt the host holds (``tokens``): a longer prompt grows its
    temporary, the input signature stays the same."""

    tokens = 0

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        if _Prompt.tokens:
            ctx = torch.ones(x.shape[0], _Prompt.tokens, x.shape[-1], device=x.device, dtype=x.dtype)
            h = h + (torch.softmax(h @ ctx.transpose(1, 2), -1) @ ctx)[..., :1] * 0
        return h


def check_outgrow(dev, d: int = 1024, depth: int = 8, tokens: int = 256, steps: int = 8,
                  inputs_on=None, host=contextlib.nullcontext) -> dict:
    """(``inputs_on``, ``host``: where the inputs live and the context the model is built in;
    the tests run it small on the simulated accelerator.)"""
    on = dev if inputs_on is None else inputs_on
    _Prompt.tokens = 0
    with host():
        model = toys.seeded(torch.nn.Sequential(*[_Prompt(d) for _ in range(depth)]))
        x = (torch.randn(2, tokens, d, generator=torch.Generator().manual_seed(4)).to(on),)
        ref = model.to(on)(*x)
        model.to("cpu")
    budget = _budget_to_stream(model, x, dev, share=0.6)
    eng = Engine(model, EngineConfig(budget_bytes=budget, device=str(dev)))
    peaks, exact, syncs = [], [], []
    try:
        with eng.session():
            for i in range(steps):
                if i == 3:  # a longer prompt: the temporary grows past what the plan left free
                    per = 2 * 4 * (d + 2 * tokens)  # the context and the scores, per prompt token
                    _Prompt.tokens = (budget - eng.last_plan.peak_bytes) // per + 2
                with _SyncCounter() as c:
                    exact.append(torch.equal(eng.run(model, *x), ref))
                syncs.append(c.counts["syncs"] + c.counts["empty_cache"])
                peaks.append(eng.last_stats.peak_device_bytes)
                if i == steps - 3:
                    eng.reset_stats()  # time the last two forwards (re-planned, steady)
        timing = time_per_call(eng)
    finally:
        _Prompt.tokens = 0
    replans = sum(p > budget for p in peaks)
    return {"ok": all(exact) and peaks[3] > budget and all(0 < p <= budget for p in peaks[4:])
            and syncs[-2:] == [0, 0],
            "budget_bytes": budget, "peaks": peaks, "over_budget_forwards": replans,
            "syncs_and_empty_cache_per_forward": syncs, "bit_equal": all(exact), "time_per_call": timing}


def check_teardown(dev) -> dict:
    model = toys.seeded(toys.TransformerStack(d=512, depth=8))
    x = (torch.randint(0, 50, (2, 64)).to(dev),)
    ref = model.to(dev)(*x)
    model.to("cpu")
    masters = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    eng = Engine(model, EngineConfig(budget_bytes=4 * weight_bytes(model), device=str(dev)))
    with eng.session():
        outs = [eng.run(model, *x) for _ in range(2)]
        timing = time_per_call(eng)
        held = eng.executor.holds_weights
        on_dev = sum(p.is_cuda for p in model.parameters())
        # what the adapter does on the host's detach: give the device copies back first ...
        eng.release()
        left = sum(p.is_cuda for p in model.parameters())
        model.to("cpu")        # ... then the host's move copies nothing back
        moved = [n for n, p in model.named_parameters() if p.data_ptr() != masters[n][0]]
    same = all(torch.equal(p.detach(), masters[n][1]) for n, p in model.named_parameters())
    return {"ok": held and on_dev > 0 and left == 0 and not moved and same and all(torch.equal(o, ref) for o in outs),
            "held_params_on_device": on_dev, "left_on_device_after_release": left, "copied_back": len(moved),
            "time_per_call": timing}


class _SyncCounter:
    """Counts the host-blocking CUDA calls Python code makes (and ``empty_cache``)."""

    NAMES = ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
             (torch.cuda, "synchronize"), (torch.cuda, "empty_cache"))

    def __enter__(self):
        self.counts = {"syncs": 0, "empty_cache": 0}
        self.saved = []
        for owner, name in self.NAMES:
            orig = getattr(owner, name)
            key = "empty_cache" if name == "empty_cache" else "syncs"

            def wrapped(*a, _orig=orig, _key=key, **k):
                self.counts[_key] += 1
                return _orig(*a, **k)

            self.saved.append((owner, name, orig))
            setattr(owner, name, wrapped)
        return self

    def __exit__(self, *exc):
        for owner, name, orig in self.saved:
            setattr(owner, name, orig)


def check_alternating(dev, steps: int = 10) -> dict:
    model = toys.seeded(toys.FluxLike(d=512, n_double=4, n_single=8))
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(2, 256, 16, generator=g).to(dev), torch.rand(2, generator=g).to(dev))
    b = (torch.randn(2, 1024, 16, generator=g).to(dev), torch.rand(2, generator=g).to(dev))
    refs = [model.to(dev)(*a), model(*b)]
    model.to("cpu")
    eng = Engine(model, EngineConfig(budget_bytes=_budget_to_stream(model, b, dev), device=str(dev)))
    exact, ran = [], []
    with eng.session():
        for i in range(4):
            eng.run(model, *(a, b)[i % 2])
        eng.reset_stats()  # time the steady forwards below
        with _SyncCounter() as c:
            for i in range(steps):
                exact.append(torch.equal(eng.run(model, *(a, b)[i % 2]), refs[i % 2]))
                ran.append(eng.last_plan)
    per = {k: v / steps for k, v in c.counts.items()}
    return {"ok": all(exact) and per["syncs"] == 0 and per["empty_cache"] == 0,
            "host_syncs_per_forward": per["syncs"], "empty_cache_per_forward": per["empty_cache"],
            "bit_equal": all(exact), "time_per_call": time_per_call(eng, plans=ran)}


def check_second_gpu() -> dict:
    if torch.cuda.device_count() < 2:
        return {"ok": None, "why": "one GPU"}
    dev = torch.device("cuda:1")
    torch.cuda.set_device(0)
    model = toys.seeded(toys.TransformerStack(d=512, depth=8))
    x = (torch.randint(0, 50, (2, 64)).to(dev),)
    ref = model.to(dev)(*x)
    model.to("cpu")
    before = torch.cuda.memory_allocated(0)
    eng = Engine(model, EngineConfig(budget_bytes=_budget_to_stream(model, x, dev), device=str(dev)))
    with eng.session():
        outs = [eng.run(model, *x) for _ in range(4)]
    grew = torch.cuda.memory_allocated(0) - before
    return {"ok": all(torch.equal(o, ref) for o in outs) and grew == 0, "cuda0_bytes_allocated": grew,
            "time_per_call": time_per_call(eng)}


def check_devices(d: int = 1024, depth: int = 16, tokens: int = 256, steps: int = 6, inputs_on=None,
                  host=contextlib.nullcontext, share: float = 0.5) -> dict:
    """One model across two GPUs (``EngineConfig.devices``) against one GPU streaming it under one
    of the two budgets: bit-equal on every forward, each device's peak (the engine's per-forward
    allocator read) within its own budget on every forward, host syncs in a steady forward, and
    the time per call of each (synchronised around the steady calls). Skipped with the reason
    below two GPUs. (``inputs_on``, ``host``: as ``check_outgrow``; the tests run it small on the
    simulated accelerator with two devices.)"""
    if torch.cuda.device_count() < 2:
        return {"ok": None, "why": f"{torch.cuda.device_count()} GPU(s): the check needs two"}
    home = torch.device("cuda:0")
    on = home if inputs_on is None else inputs_on
    with host():
        model = toys.seeded(toys.MMDiTLike(d=d, n_double=depth // 2, n_single=depth - depth // 2))
        g = torch.Generator().manual_seed(5)
        x = tuple(t.to(on) for t in (torch.randn(1, tokens, 16, generator=g), torch.randn(1, tokens // 4, 12, generator=g),
                                      torch.rand(1, generator=g), torch.randn(1, tokens + tokens // 4, 2, generator=g)))
        ref = model.to(on)(*x)
        model.to("cpu")
    if inputs_on is not None:
        x = tuple(t.clone() for t in x)  # (the simulator: device memory of cuda:0, as a host gives them)
    b = _budget_to_stream(model, x, home, share=share)
    runs = {}
    for name, devices in (("one_gpu", (("cuda:0", b),)), ("two_gpus", (("cuda:0", b), ("cuda:1", b)))):
        eng = Engine(model, EngineConfig(budget_bytes=sum(v for _, v in devices), device="cuda:0", devices=devices))
        exact, peaks, syncs, times = [], [], [], []
        with eng.session():
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with _SyncCounter() as c:
                    out = eng.run(model, *x)
                syncs.append(c.counts["syncs"])
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                exact.append(torch.equal(out, ref))
                per = ({k: s.peak_device_bytes for k, s in eng.last_device_stats.items()} if eng.group is not None
                       else {"cuda:0": eng.last_stats.peak_device_bytes})
                peaks.append(per)
        js = eng.describe()["plan"]
        runs[name] = {"bit_equal": all(exact), "peaks": peaks,
                      "within_budgets": all(p <= dict(devices)[k] for per in peaks for k, p in per.items()),
                      "steady_host_syncs": syncs[1:], "s_per_call": sum(times[1:]) / max(1, len(times) - 1),
                      "host_bytes_per_call": js["streamed_bytes_per_forward"],
                      "hop_bytes_per_call": js.get("hop_bytes_per_call", 0), "hops": js.get("hops", []),
                      "time_per_call": time_per_call(eng)}
        eng.release()
    one, two = runs["one_gpu"], runs["two_gpus"]
    return {"ok": all(r["bit_equal"] and r["within_budgets"] and not any(r["steady_host_syncs"]) for r in runs.values()),
            "budget_bytes_per_device": b, "one_gpu": one, "two_gpus": two,
            "speedup": one["s_per_call"] / two["s_per_call"] if two["s_per_call"] else None}


def round2(dev) -> dict:
    out = {}
    for name, fn in (("kitchen", lambda: check_kitchen(dev)), ("replan", lambda: check_replan(dev)),
                     ("outgrow", lambda: check_outgrow(dev)),
                     ("teardown", lambda: check_teardown(dev)), ("alternating", lambda: check_alternating(dev)),
                     ("second_gpu", check_second_gpu), ("compiler", gpu_compiler_check.check),
                     ("file_backed", lambda: gpu_file_backed_check.check(dev, _budget_to_stream, timing=time_per_call)),
                     ("detach", gpu_detach_check.check), ("devices", check_devices)):
        try:
            with torch.no_grad():
                out[name] = _say(name, fn())
        except Exception as e:
            out[name] = _say(name, {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
    return out


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
            "bandwidth": {"pinned_h2d_gbps": NOT, "engine_h2d_bytes_per_s": NOT, "engine_h2d_source": NOT},
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
                        "engine_h2d_source": engine_bw["source"]}
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
