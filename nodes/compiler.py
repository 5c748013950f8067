"""The host's model compiler (ComfyUI 0.38's recorded allocation graphs), kept off while VRAMCut
runs a model. Owns one process-wide hold on the host's switch; the one rule: no VRAMCut forward
runs inside a recorded allocation graph, and the host's switch is as the host had it once no
VRAMCut call is in flight. May call ComfyUI's cli_args only.

ComfyUI 0.38's compiler (on wherever comfy-aimdo's dynamic VRAM is on, NVIDIA) records a
forward's device allocations into a per-thread "malloc graph" and replays them on later steps.
Newer families (Qwen-Image 2.1, MiniMax H3, the decode loops of several LLM text encoders) open
the recording inside their own forward (``comfy.model_prefetch.malloc_graph_begin``), whatever
the patcher. A VRAMCut forward does not repeat itself the way a recording needs (a measuring
first step, copies on a side stream, buffers swapped at every block), and the measured peak must
be the allocator's own, so the compiler stays off while VRAMCut runs a model. The host reads one
process-wide switch at every ``malloc_graph_begin`` (``args.disable_comfy_compiler``, the
``--disable-comfy-compiler`` option, which also turns off the CUDA graphs the compiler captures):
there is no per-model option. Only a recording begun after VRAMCut's entry point is prevented;
in 0.38 every recording begins inside a model's forward, after them. Hosts without the compiler
(0.3.x, 0.33.0) have no such switch: nothing to do there.
"""
from __future__ import annotations

import contextlib
import threading

_LOCK = threading.Lock()
_holds = 0        # VRAMCut calls in flight (any thread) that hold the compiler off
_saved = None     # the switch as the host had it before the first of them


@contextlib.contextmanager
def compiler_off():
    """The host's model compiler off for the block, and the host's switch put back as it was
    when the last overlapping block ends, whatever happens. Nested and overlapping blocks (a
    sampling run, the model calls inside it, another thread's call) share one hold. A no-op on
    hosts without the compiler, and leaves a user's ``--disable-comfy-compiler`` as it is."""
    global _holds, _saved
    from comfy.cli_args import args
    if not hasattr(args, "disable_comfy_compiler"):
        yield
        return
    with _LOCK:
        if _holds == 0:
            _saved = getattr(args, "disable_comfy_compiler")
            args.disable_comfy_compiler = True
        _holds += 1
    try:
        yield
    finally:
        with _LOCK:
            _holds -= 1
            if _holds == 0:
                args.disable_comfy_compiler = _saved
