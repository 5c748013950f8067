"""The ``file_backed`` check of ``bench/gpu_check.py``: fast-disk loading on a real GPU.

A transformer saved to a safetensors file and loaded mapped from it (as ComfyUI keeps a model it
streams from a fast disk) runs under a budget that streams about half its weights, once with the
mapped tensors as their own host masters (``keep_file_backed``: bytes go through the page-locked
staging window) and once from a copy in RAM with flat page-locked masters (the usual path):

* forwards 1..4 bit-equal to the plain forward on the device, both ways;
* with the window: no flat master made, the mapped tensors still the module's, the pack's
  page-locked bytes no more than the window's pieces;
* per-forward time and page-locked bytes of both ways (what the window costs in speed: the host
  fills a piece from the mapping, then the copy stream moves it).

``inputs_on`` is where the inputs and the reference output live: the device on a GPU; the CPU on
the simulated accelerator (``tests/core/test_gpu_check.py`` runs the check there, small, so it
is known to run before the first GPU minutes).
"""
from __future__ import annotations

import contextlib
import gc
import tempfile
import time

import gpu_common  # noqa: F401  (puts the checkout on the import path)
import torch  # noqa: E402

import toys  # noqa: E402
from vramcut_core import Engine, EngineConfig  # noqa: E402
from vramcut_core.runtime import host_memory as hm  # noqa: E402


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _run(model, x, ref, dev, budget, keep: bool, forwards: int, timing=None) -> dict:
    gc.collect()   # masters of engines gone before let go now, not during this run (the count below)
    pinned0 = hm.PAGE_LOCKED.bytes
    eng = Engine(model, EngineConfig(budget_bytes=budget, device=str(dev), keep_file_backed=keep))
    exact, times = [], []
    with eng.session():
        for _ in range(forwards):
            _sync(dev)
            t = time.perf_counter()
            out = eng.run(model, *x)
            _sync(dev)
            times.append(time.perf_counter() - t)
            exact.append(torch.equal(out, ref))
        pinned = hm.PAGE_LOCKED.bytes - pinned0
        flat = len(eng.executor.masters.masters)
    out = {"bit_equal_per_forward": exact, "page_locked_bytes": pinned, "flat_masters": flat,
           "first_forward_s": times[0], "forward_s": min(times[1:]) if len(times) > 1 else None,
           "streamed_bytes_per_forward": eng.last_plan.streamed_bytes_per_forward}
    if timing is not None:
        out["time_per_call"] = timing(eng)
    return out


def check(dev, budget_to_stream, d: int = 1024, depth: int = 8, tokens: int = 256, forwards: int = 4,
          inputs_on: torch.device | None = None, host=None, timing=None) -> dict:
    """Both ways on ``dev`` under ``budget_to_stream(model, inputs, dev)`` (``gpu_engine_checks``': about
    half the weights streamed, measured on the copy in RAM, as a probe's flat masters would take
    the mapped tensors' place); ``host`` is a context for building host tensors (the
    simulator's); ``timing(engine)``, where given, each way's predicted against measured time per
    call (``gpu_timing.time_per_call``)."""
    host = host or contextlib.nullcontext
    place = inputs_on if inputs_on is not None else dev

    def build():
        return toys.TransformerStack(d=d, depth=depth)

    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        with host():
            src = toys.seeded(build())
            x = (torch.randint(0, 50, (2, tokens), generator=torch.Generator().manual_seed(0)),)
            mapped = toys.map_from_file(toys.seeded(build()), folder)
            where = {k: t.data_ptr() for k, t in mapped.state_dict(keep_vars=True).items()}
        x = tuple(a.to(place) for a in x)
        ref = src.to(place)(*x)
        src.to("cpu")
        budget = budget_to_stream(src, x, dev)
        window = _run(mapped, x, ref, dev, budget, True, forwards, timing)
        flat = _run(src, x, ref, dev, budget, False, forwards, timing)
        kept = where == {k: t.data_ptr() for k, t in mapped.state_dict(keep_vars=True).items()}
    cap = hm.BOUNCE_PIECES * hm.BOUNCE_PIECE
    ok = (all(window["bit_equal_per_forward"]) and all(flat["bit_equal_per_forward"]) and kept
          and window["flat_masters"] == 0 and window["page_locked_bytes"] <= cap)
    return {"ok": ok, "budget_bytes": budget, "window_cap_bytes": cap, "mapped_tensors_kept": kept,
            "file_backed": window, "flat_masters": flat}
