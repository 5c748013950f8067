"""A stand-in for the model compiler of ComfyUI 0.38 (``comfy.model_prefetch``'s recorded
allocation graphs), for tests on the simulated accelerator (``tests/sim_cuda.py``).

What the host does, read from its 0.38 sources (``comfy/model_prefetch.py``; comfy-aimdo's
``MallocGraph`` itself is native code):

* ``malloc_graph_enabled(device)``: ``not args.disable_comfy_compiler``, comfy-aimdo on, a CUDA
  device. Read at every ``malloc_graph_begin``;
* ``malloc_graph_begin(device)``: when enabled, the thread's graph is made (``record``) or
  pushed, and marked active; ``malloc_graph_end()`` pops it and counts a graph break when the
  allocations differed from the recording; ``cleanup_malloc_graph()`` aborts it;
* ``pause_malloc_graph(sync=False)``: a context pausing the thread's active graph and resuming
  it after (a flag, not a count: a pause inside a pause resumes early);
* ``prefetch_queue_pop(queue, device, module, ..., malloc_scope=None)``: with an active graph,
  starts a new scope of the recording (one per block) before the block runs;
* ``make_prefetch_queue(queue, device, transformer_options)``: None unless the dynamic-VRAM
  loader asked for prefetch (``prefetch_dynamic_vbars``), as for a VRAMCut patcher.

The stand-in keeps the API and, instead of planning, records: every device allocation made while
a graph is active and not paused (``allocations``, with the block being run), and which blocks
started while one was active (``blocks_recorded``). Like the arena a recording plans, it keeps
what it recorded until the graph ends: blocks freed while recording are given back at
``malloc_graph_end``, so a forward that runs inside the recording peaks higher than the same
forward outside it. Every tensor of the simulated accelerator lives in host memory, so the
device test of ``malloc_graph_enabled`` is left out.

``Qwen21Shaped`` and ``sample_through_wrappers`` (a patched model run as ComfyUI's sampler runs
it) need no stand-in: ``bench/gpu_compiler_check.py`` runs them under a real host's compiler.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch


class MallocGraph:
    """The thread's recording (comfy-aimdo's ``MallocGraph`` as the host uses it)."""

    def __init__(self) -> None:
        self._comfy_active = False
        self.paused = False
        self.scopes = 0
        self.deferred: list = []   # (block, prev) frees held until the graph ends

    def push(self) -> None:
        self.scopes = 0

    def pause(self, sync: bool = False) -> None:
        self.paused = True

    def resume(self, sync: bool = False) -> None:
        self.paused = False

    def iterate(self, scope) -> bool:
        self.scopes += 1
        return False


class CompilerStandIn:
    """Installs a ``comfy.model_prefetch`` with the compiler's API (see the module docstring) and
    watches the simulated allocator."""

    def __init__(self, monkeypatch, sim) -> None:
        import comfy
        from comfy.cli_args import args

        self.args, self.sim = args, sim
        self.graphs: dict[int, MallocGraph] = {}
        self.allocations: list[tuple[int, str]] = []   # (bytes, block running) while recording
        self.blocks_recorded: list[str] = []
        self.begun = 0
        self.running = ""          # the block the model's forward is in (set by the model)
        mod = types.ModuleType("comfy.model_prefetch")
        mod.malloc_graph_enabled = self.enabled
        mod.malloc_graph_begin = self.begin
        mod.malloc_graph_end = self.end
        mod.cleanup_malloc_graph = self.cleanup
        mod.pause_malloc_graph = self.pause
        mod.make_prefetch_queue = lambda queue, device, transformer_options: None
        mod.prefetch_queue_pop = self.pop
        mod.MALLOC_GRAPHS = self.graphs
        self.module = mod
        monkeypatch.setitem(sys.modules, "comfy.model_prefetch", mod)
        monkeypatch.setattr(comfy, "model_prefetch", mod, raising=False)
        monkeypatch.setattr(args, "disable_comfy_compiler", False, raising=False)
        alloc = sim.alloc
        orig_alloc, orig_free = alloc.alloc, alloc.free
        recorded: set[int] = set()   # blocks allocated while recording (the blocks have slots)

        def watched_alloc(n, stream_id):
            b = orig_alloc(n, stream_id)
            if b is not None and self.recording():
                self.allocations.append((n, self.running))
                recorded.add(id(b))
            return b

        def watched_free(b, prev):
            g = self.graph()
            if id(b) in recorded and g is not None and g._comfy_active:
                g.deferred.append((b, prev))   # the recording's arena keeps it until the end
                return
            recorded.discard(id(b))
            orig_free(b, prev)

        self._free = watched_free
        monkeypatch.setattr(alloc, "alloc", watched_alloc)
        monkeypatch.setattr(alloc, "free", watched_free)

    # -- the host's API ---------------------------------------------------------------------

    def graph(self) -> MallocGraph | None:
        return self.graphs.get(threading.get_ident())

    def recording(self) -> bool:
        g = self.graph()
        return bool(g is not None and g._comfy_active and not g.paused)

    def enabled(self, device=None) -> bool:
        return not getattr(self.args, "disable_comfy_compiler", True)

    def begin(self, device=None) -> None:
        if not self.enabled(device):
            return
        g = self.graph()
        if g is None:
            g = self.graphs[threading.get_ident()] = MallocGraph()
        else:
            g.push()
        g._comfy_active = True
        self.begun += 1

    def end(self) -> None:
        g = self.graph()
        if g is not None and g._comfy_active:
            g._comfy_active = False
            g.paused = False
            held, g.deferred = g.deferred, []
            for b, prev in held:
                self._free(b, prev)

    def cleanup(self) -> None:
        self.end()
        self.graphs.pop(threading.get_ident(), None)

    @contextlib.contextmanager
    def pause(self, sync: bool = False):
        g = self.graph()
        active = g is not None and g._comfy_active
        if active:
            g.pause(sync)
        try:
            yield
        finally:
            if active:
                g.resume(sync)

    def pop(self, queue, device, module, dtype=None, core=None, enable_graph=False, generator=None,
            malloc_scope=None) -> None:
        g = self.graph()
        if g is not None and g._comfy_active and malloc_scope is not None:
            g.iterate(malloc_scope if module is not None else None)
        if core is not None:
            core()


class Qwen21Shaped(torch.nn.Module):
    """The forward of ComfyUI 0.38's Qwen-Image 2.1 transformer as far as the compiler goes
    (``comfy/ldm/qwen_image21/model.py``): embedders, then one block list run inside a recording
    it opens itself, ``prefetch_queue_pop`` before each block and once after the last, the
    recording closed, then the output layers. Its blocks (``transformer_blocks``) are plain MLP
    blocks; ``stand_in.running`` names the block in flight for the allocation record."""

    def __init__(self, d: int = 64, depth: int = 6, stand_in: CompilerStandIn | None = None) -> None:
        super().__init__()
        from toys import MLPBlock

        self.img_in = torch.nn.Linear(16, d)
        self.time_in = torch.nn.Linear(1, d)
        self.transformer_blocks = torch.nn.ModuleList(MLPBlock(d) for _ in range(depth))
        self.norm_out = torch.nn.LayerNorm(d)
        self.proj_out = torch.nn.Linear(d, 16)
        self.stand_in = stand_in

    def forward(self, x, timestep, **_):
        prefetch = sys.modules["comfy.model_prefetch"]
        h = self.img_in(x) + self.time_in(timestep[:, None, None])
        queue = prefetch.make_prefetch_queue(list(self.transformer_blocks), x.device, {})
        prefetch.malloc_graph_begin(x.device)
        for i, block in enumerate(self.transformer_blocks):
            prefetch.prefetch_queue_pop(queue, x.device, block, malloc_scope="block")
            if self.stand_in is not None:
                self.stand_in.running = f"transformer_blocks.{i}"
                if self.stand_in.recording():
                    self.stand_in.blocks_recorded.append(f"transformer_blocks.{i}")
            h = block(h)
        prefetch.prefetch_queue_pop(queue, x.device, None, malloc_scope="block")
        prefetch.malloc_graph_end()
        if self.stand_in is not None:
            self.stand_in.running = ""
        return self.proj_out(self.norm_out(h))


class BaseModelStandIn(torch.nn.Module):
    """What the APPLY_MODEL wrapper reads of ComfyUI's BaseModel."""

    def __init__(self, diffusion_model) -> None:
        super().__init__()
        self.diffusion_model = diffusion_model
        self.current_patcher = None


def sample_through_wrappers(pack, model, x, t, budget: int, steps: int, device="cuda"):
    """A sampling run of a patched model through the pack's wrappers, called as ComfyUI calls
    them (``WrapperExecutor``: OUTER_SAMPLE around the run, APPLY_MODEL around each step, the
    patcher's ON_PRE_RUN / ON_CLEANUP around the steps). Returns the outputs, the measured peak
    of each step (where the step measured one), the engine's measurements by unit, the engine."""
    import comfy.model_patcher
    import comfy.patcher_extension as pe

    st = pack.nodes.state
    base = BaseModelStandIn(model)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=torch.device(device),
                                               offload_device=torch.device("cpu"))
    settings = st.Settings(max_vram_gb=budget / (1 << 30))
    clone = pack.nodes.patching.patch_model(patcher, settings, pack.nodes.report.NodeReport(None, settings))
    engine = st.state_of(clone)._engines[model]
    options = {"transformer_options": {"wrappers": clone.wrappers}}
    outer = pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, options, is_model_options=True)
    apply = pe.get_all_wrappers(pe.WrappersMP.APPLY_MODEL, options["transformer_options"])
    assert outer and apply, "the pack registers both wrappers"
    peaks = []

    def step():
        out = pe.WrapperExecutor.new_class_executor(
            lambda x_, t_: base.diffusion_model(x_, t_), base, apply).execute(x, t)
        peaks.append(engine.last_stats.peak_device_bytes)
        return out

    def run(steps):
        clone.pre_run()
        base.current_patcher = clone
        try:
            return [step() for _ in range(steps)]
        finally:
            clone.cleanup()

    guider = types.SimpleNamespace(model_patcher=clone)
    with torch.no_grad():
        outs = pe.WrapperExecutor.new_class_executor(run, guider, outer).execute(steps)
    meas = {sig: {u: (m.entry_bytes, m.peak_bytes, m.calls) for u, m in ms.items()}
            for sig, ms in engine.measurements.items()}
    return outs, peaks, meas, engine
