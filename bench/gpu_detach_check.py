"""The ``detach`` check of ``bench/gpu_check.py``: a detach during sampling on a host that
page-locks the offloaded weights itself (ComfyUI 0.33+: ``ModelPatcher.pin_weight_to_device`` at
load, ``unpin_all_weights`` from ``unpatch_model(..., unpatch_weights=True)``, by address).

A small model of the host's own layers is patched through the pack's Max VRAM node (part of its
weights streamed) and sampled as ComfyUI samples it (OUTER_SAMPLE and APPLY_MODEL wrappers,
ON_PRE_RUN / ON_CLEANUP); in the second step, from inside the forward (a hook on a block whose
weights are the engines' device copies then), the host detaches the patched model, and after the
run unloads every model (``unload_all_models``). Passes when the host pinned the weights at its
load and, after the unload, nothing of the model is left page-locked (in the host's table or
registered at all), no "Tried to unpin tensor not pinned by ComfyUI" (or other unpin) warning
was logged, and the next run is bit-equal to the first.

Runs in a fresh process (``--child``): the host is imported for the GPU there, as its
``main.py`` would. The host is found as the tests find it (``$COMFYUI_PATH``, else
``~/comfy/ComfyUI``); without one, or on a host that does not page-lock offloaded weights itself
(0.3.6x), or with its page-locking off, it reports ``"ok": None`` and ``"why": "skipped: ..."``.
The pack is imported as ComfyUI imports it and used through its nodes only. :func:`scenario`
is what the tests run on the simulated accelerator.

    python bench/gpu_detach_check.py [--child]
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import types

import gpu_common  # (puts the checkout on the import path)

SKIP = "skipped"
GIB = 1 << 30


def check(timeout: int = 300) -> dict:
    """The check, run in a child process; its JSON, or why it did not run."""
    return gpu_common.run(__file__, timeout)


def _host():
    """``(pack, None)`` with the host imported for the GPU and its page-locking on, or
    ``(None, why not)``."""
    import tiny_models

    path = tiny_models.comfyui_path()
    if path is None:
        return None, f"{SKIP}: no ComfyUI host (set COMFYUI_PATH to a ComfyUI checkout)"
    import torch

    if not torch.cuda.is_available():
        return None, f"{SKIP}: no GPU"
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import comfy.model_management as mm
        import comfy.model_patcher
        import comfy.ops  # noqa: F401
        import comfy.patcher_extension  # noqa: F401
    except Exception as e:  # a host that does not import here is a check not run, not a crash
        return None, f"{SKIP}: ComfyUI at {path} does not import ({type(e).__name__}: {e})"[:500]
    if not hasattr(comfy.model_patcher.ModelPatcher, "unpin_all_weights"):
        return None, f"{SKIP}: this host does not page-lock offloaded weights itself"
    if mm.MAX_PINNED_MEMORY <= 0:
        return None, f"{SKIP}: the host's page-locking is off here"
    from pack_nodes import load_pack
    return load_pack(), None


def child() -> dict:
    pack, why = _host()
    if pack is None:
        return {"ok": None, "why": why}
    import torch

    with torch.no_grad():
        return scenario(pack, torch.device("cuda"))


def _stack(d: int, depth: int):
    """Host layers (``comfy.ops``, so the host offloads and pins them) in a block list."""
    import comfy.ops
    import torch

    ops = comfy.ops.disable_weight_init

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = ops.Linear(d, 2 * d), ops.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = ops.Linear(16, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
            self.out = ops.Linear(d, 16)

        def forward(self, x, timestep, **_):
            h = self.inp(x) * timestep[:, None, None]
            for b in self.blocks:
                h = b(h)
            return self.out(h)

    return Stack()


class _Warnings(logging.Handler):
    """The warnings about unpinning logged while it is installed (on the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        msg = record.getMessage()
        if "unpin" in msg.lower():
            self.messages.append(msg)

    def __enter__(self):
        self.root = logging.getLogger()
        self.level = self.root.level
        self.root.addHandler(self)
        self.root.setLevel(min(self.level or logging.WARNING, logging.WARNING))
        return self

    def __exit__(self, *exc):
        self.root.removeHandler(self)
        self.root.setLevel(self.level)


def scenario(pack, dev, d: int = 1024, depth: int = 8, steps: int = 3, room_bytes: int = 64 << 20,
             inputs_on=None, host=contextlib.nullcontext, on_device=None) -> dict:
    """The check itself, in the process the host and the pack are imported in: a budget of 40%
    of the weights and ``room_bytes`` for the activations. (The tests run it small on the
    simulated accelerator: ``inputs_on``, ``host`` and ``on_device`` say where the inputs live,
    the context the model is built in and how a device tensor is told.)"""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.patcher_extension as pe
    import torch
    from compiler_host import BaseModelStandIn
    from pack_nodes import run_node

    on = dev if inputs_on is None else inputs_on
    on_device = on_device or (lambda t: t.device.type == dev.type)
    with host():
        torch.manual_seed(0)
        model = _stack(d, depth)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=d ** -0.5)
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(2, 8, 16, generator=g).to(on), torch.rand(2, generator=g).to(on)
        with torch.no_grad():
            ref = model.to(on)(x, t).float().cpu()   # the plain forward
        model.to("cpu")
    masters = [p.detach() for p in model.parameters()]
    ptrs = {m.data_ptr() for m in masters}
    weights = sum(m.numel() * m.element_size() for m in masters)
    base = BaseModelStandIn(model)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=dev, offload_device=torch.device("cpu"))
    (clone, _, _), _ = run_node(pack, "VRAMCutMaxVRAM", max_vram_gb=(weights * 0.4 + room_bytes) / GIB,
                                budget_mode="fixed", reserve_gb=1.0, prefetch=True, residency=True, model=patcher)
    pinned_at_load, detached, host_pinned = [], [], []
    armed = [False]

    def hook(mod, _args, _out):
        # inside a forward, on the engines' device copies: the host tears the model down
        if armed[0] and not detached and any(on_device(p) for p in mod.parameters()):
            clone.detach(unpatch_all=True)
            detached.append(True)

    def run(n):
        options = {"transformer_options": {"wrappers": clone.wrappers}}
        outer = pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, options, is_model_options=True)
        apply = pe.get_all_wrappers(pe.WrappersMP.APPLY_MODEL, options["transformer_options"])
        clone.load(dev)
        pinned_at_load.append(len(ptrs & set(mm.PINNED_MEMORY)))
        for w in masters + [p.detach() for p in model.parameters()]:   # what the host page-locked
            if w.data_ptr() in mm.PINNED_MEMORY and all(w is not k for k in host_pinned):
                host_pinned.append(w)

        def steps_(k):
            clone.pre_run()
            base.current_patcher = clone
            outs = []
            try:
                for i in range(k):
                    armed[0] = i == 1
                    outs.append(pe.WrapperExecutor.new_class_executor(
                        lambda x_, t_: base.diffusion_model(x_, t_), base, apply).execute(x, t).float().cpu())
            finally:
                armed[0] = False
                clone.cleanup()
            return outs

        return pe.WrapperExecutor.new_class_executor(steps_, types.SimpleNamespace(model_patcher=clone),
                                                     outer).execute(n)

    def left():
        """(the host's table entries, the host's page-locked tensors still registered)"""
        pins = {w.data_ptr() for w in host_pinned} & set(mm.PINNED_MEMORY)
        return len(pins), sum(w.is_pinned() for w in host_pinned)

    h = model.blocks[depth // 2].register_forward_hook(hook)
    with _Warnings() as warned:
        try:
            first = run(steps)
        finally:
            h.remove()
        mm.unload_all_models()
        gc.collect()
        host_pins_left, page_locked_left = left()
        again = run(steps)
        clone.detach(unpatch_all=True)
        mm.unload_all_models()
        gc.collect()
        after_next = left()
    exact = all(torch.equal(a, b) for a, b in zip(first, again)) and len(first) == len(again) == steps
    ok = (bool(detached) and pinned_at_load[0] == len(ptrs) and host_pins_left == 0 and page_locked_left == 0
          and not warned.messages and exact and after_next == (0, 0))
    return {"ok": ok, "detached_inside_a_forward": bool(detached), "pinned_by_host_at_load": pinned_at_load[0],
            "weights": len(ptrs), "host_pins_left": host_pins_left, "page_locked_left": page_locked_left,
            "unpin_warnings": warned.messages[:3], "next_run_bit_equal": exact,
            "bit_equal_to_plain": all(torch.equal(o, ref) for o in first + again),
            "left_after_next_run": list(after_next),
            "time_per_call": {"predicted_s": None, "measured_s": None, "error": None,
                              "no_prediction": "the host detaches the model inside a forward: no steady calls to time"}}


if __name__ == "__main__":
    gpu_common.main(__file__, child)
