"""The engine's checks on a real GPU, run first by ``bench/gpu_check.py`` (a few seconds each; one
line each on stderr as it finishes). Each returns ``{"ok": True, False or None (not applicable),
...figures}``:

* ``kitchen``: comfy-kitchen fp8 and nvfp4 weights streamed with prefetch, forwards 1..5
  bit-equal to the unpatched model, every weight part inside the executor's buffers;
* ``replan``: a budget a block's intra-module temporary overshoots while measuring: a finer cut,
  ``max_memory_reserved`` within the budget on every forward;
* ``outgrow``: a block's temporary grows mid-run with the same input shape (a longer prompt held
  by the host): the forward over the budget is seen, re-planned once, later forwards within it,
  no host sync and no ``empty_cache`` per steady step after;
* ``teardown``: weights held by a session, the host's release and move to the offload device
  while held: nothing left on the device, no parameter copied back, values unchanged;
* ``alternating``: two cached shapes in turn, host syncs (stream, event, device) and
  ``empty_cache`` calls counted per steady forward;
* ``second_gpu``: a model on ``cuda:1`` with ``cuda:0`` current (where two GPUs exist):
  bit-equal, nothing allocated on ``cuda:0``;
* ``compiler``: a Qwen-Image-2.1-shaped model under the host's model compiler (ComfyUI 0.38+
  named by ``COMFYUI_PATH``), in a fresh process: no recording begun while VRAMCut runs it, the
  same measured peaks as with the compiler off (``bench/gpu_compiler_check.py``; elsewhere
  "skipped: host has no compiler");
* ``file_backed``: a transformer mapped from a safetensors file (fast-disk loading) streamed with
  the mapped tensors as masters through the page-locked window, and from RAM with flat masters:
  bit-equal both ways, no flat master and no more page-locked than the window with it, the time
  per forward of each (``bench/gpu_file_backed_check.py``);
* ``detach``: a detach during sampling on a host that page-locks the offloaded weights itself
  (ComfyUI 0.33+ found as the tests find it), in a fresh process: the host detaches the patched
  model from inside a forward, then unloads every model: nothing of the model left page-locked by
  the host, no "Tried to unpin tensor not pinned by ComfyUI" warning, the next run bit-equal to
  the first (``bench/gpu_detach_check.py``; without such a host "skipped: ..." and why);
* ``devices``: one model across two GPUs against one GPU streaming it under one of the two
  budgets: bit-equal on every forward, each device's peak within its own budget, no host sync in
  a steady forward, the time per call of each (where two GPUs exist).

Every check that runs an engine adds ``time_per_call`` (``bench/gpu_timing.py``).
"""
from __future__ import annotations

import contextlib
import sys
import time

import gpu_common  # noqa: F401  (puts the checkout on the import path)
import torch  # noqa: E402

import gpu_compiler_check  # noqa: E402
import gpu_detach_check  # noqa: E402
import gpu_file_backed_check  # noqa: E402
import toys  # noqa: E402
from gpu_common import weight_bytes  # noqa: E402
from gpu_timing import time_phrases, time_per_call  # noqa: E402
from vramcut_core import Engine, EngineConfig  # noqa: E402

CHECKS = ("kitchen", "replan", "outgrow", "teardown", "alternating", "second_gpu", "compiler", "file_backed",
          "detach", "devices")


def _say(name: str, res: dict) -> dict:
    figures = ", ".join(f"{k}={v}" for k, v in _without_times(res).items() if k != "ok")
    times = "; ".join(time_phrases(res))
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
