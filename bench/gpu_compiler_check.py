"""The ``compiler`` check of ``bench/gpu_check.py``: a Qwen-Image-2.1-shaped model (its forward
opens the host's allocation recording around its blocks, as Qwen-Image 2.1's does in ComfyUI
0.38) sampled through the pack's wrappers under the host's own model compiler, and again with the
compiler off (``--disable-comfy-compiler``): bit-equal outputs, the same measured peaks, no
recording begun while VRAMCut ran the model, the host's switch as it was after the run.

Runs in a fresh process (``--child``): comfy-aimdo must be set up before CUDA is first used, as
ComfyUI's ``main.py`` does. Needs ``COMFYUI_PATH`` naming a host that has the compiler
(``comfy.model_prefetch.malloc_graph_begin`` and ``args.disable_comfy_compiler``) and a GPU
comfy-aimdo supports; anywhere else it reports ``"ok": None`` and ``"why": "skipped: host has
no compiler (...)"``.

    python bench/gpu_compiler_check.py [--child]
"""
from __future__ import annotations

import os

import gpu_common  # (puts the checkout on the import path)

SKIP = "skipped: host has no compiler"
STEPS = 4


def check(timeout: int = 300) -> dict:
    """The check, run in a child process; its JSON, or why it did not run."""
    return gpu_common.run(__file__, timeout)


def _host():
    """``(pack, prefetch, args, None)`` with the host set up as its ``main.py`` sets it up for
    dynamic VRAM, or ``(None, None, None, why not)``."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return None, None, None, f"{SKIP} (no ComfyUI host: set COMFYUI_PATH)"
    source = os.path.join(path, "comfy", "model_prefetch.py")
    if not os.path.isfile(source) or "def malloc_graph_begin" not in open(source, encoding="utf-8").read():
        return None, None, None, SKIP   # read before importing: the host needs a GPU to import
    try:
        import comfy_aimdo.control
    except ImportError:
        return None, None, None, f"{SKIP} (comfy-aimdo is not installed)"
    if not comfy_aimdo.control.init():
        return None, None, None, f"{SKIP} (comfy-aimdo does not load here)"
    import torch
    from bench_offload import import_host

    comfy, why = import_host(torch.device("cuda"))
    if comfy is None:
        return None, None, None, f"{SKIP} ({why})"
    from comfy.cli_args import args
    try:
        import comfy.model_prefetch as prefetch
    except ImportError:
        prefetch = None
    if prefetch is None or not hasattr(prefetch, "malloc_graph_begin") or not hasattr(args, "disable_comfy_compiler"):
        return None, None, None, SKIP
    import comfy.memory_management
    devices = [d.index for d in comfy.model_management.get_all_torch_devices()]
    if not comfy_aimdo.control.init_devices(devices):
        return None, None, None, f"{SKIP} (comfy-aimdo found no device it supports)"
    comfy.memory_management.aimdo_enabled = True
    if args.disable_comfy_compiler or not prefetch.malloc_graph_enabled(torch.device("cuda")):
        return None, None, None, f"{SKIP} (the host's compiler is off here)"
    from pack_nodes import load_pack
    return load_pack(), prefetch, args, None


def child() -> dict:
    pack, prefetch, args, why = _host()
    if pack is None:
        return {"ok": None, "why": why}
    import torch
    from compiler_host import Qwen21Shaped, sample_through_wrappers
    from gpu_timing import time_per_call

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 1024, 16, generator=g).to(dev), torch.rand(2, generator=g).to(dev)

    def build():
        torch.manual_seed(0)
        return Qwen21Shaped(d=1024, depth=12)

    model = build().to(dev)
    args.disable_comfy_compiler = True   # the reference: no recording at all
    with torch.no_grad():
        ref = model(x, t)
    model.to("cpu")
    units = pack.vramcut_core.find_units(model)
    block = max(u.weight_bytes for u in units.units)
    budget = max(int(units.weight_bytes * 0.45), 3 * block) + (512 << 20)
    runs = {}
    for name, off in (("compiler", False), ("no_compiler", True)):
        args.disable_comfy_compiler = off
        prefetch.MALLOC_GRAPH_USED = False
        torch.cuda.empty_cache()
        m = model if name == "compiler" else build()
        outs, peaks, _, engine = sample_through_wrappers(pack, m, x, t, budget, STEPS, device="cuda")
        runs[name] = {"peaks_bytes": peaks, "bit_equal": all(torch.equal(o, ref) for o in outs),
                      "recorded": bool(prefetch.MALLOC_GRAPH_USED), "switch_after": args.disable_comfy_compiler,
                      "time_per_call": time_per_call(engine)}
    on, off = runs["compiler"], runs["no_compiler"]
    ok = (on["bit_equal"] and off["bit_equal"] and not on["recorded"] and on["switch_after"] is False
          and on["peaks_bytes"] == off["peaks_bytes"] and max(on["peaks_bytes"]) <= budget)
    return {"ok": ok, "budget_bytes": budget, "peaks_bytes": on["peaks_bytes"],
            "peaks_without_compiler_bytes": off["peaks_bytes"], "bit_equal": on["bit_equal"],
            "recording_begun": on["recorded"], "switch_restored": on["switch_after"] is False,
            "compiler": {"time_per_call": on["time_per_call"]}, "no_compiler": {"time_per_call": off["time_per_call"]}}


if __name__ == "__main__":
    gpu_common.main(__file__, child)
