"""Host-side pieces shared by the ComfyUI test files: the quantized checkpoints of
``tests/comfy/test_quantized.py`` (test modules are not a package: loaded by path), and a host
model run on the simulated accelerator the way a CUDA host runs it (``simulated_host``, ``call``,
``sampling``)."""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import sys
import types
from typing import Callable

import pytest
import torch

from sim_cuda import simulated_cuda


def quantized_cases():
    """``tests/comfy/test_quantized.py`` as a module: its checkpoint writers and loaders
    (fp8-scaled and comfy-kitchen formats for UNETLoader, .gguf for the real ComfyUI-GGUF pack)."""
    name = "vramcut_quantized_cases"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comfy", "test_quantized.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return sys.modules[name]


@contextlib.contextmanager
def simulated_host(monkeypatch, pack, devices: int = 1):
    """``devices`` simulated GPUs, the host's main device ``cuda:0`` (what a CUDA host answers);
    fails on any hazard the simulator saw."""
    import comfy.model_management as mm

    # Fake tensors on cuda:N need no driver: where torch.cuda.is_available() says no, entering a
    # FakeTensorMode makes CUDA's device guard a no-op (what torch's python indexing sets for a
    # CUDA tensor, fake or not). This makes is_available() say yes for the host, so that step is
    # done here first; without it the first slice of a fake CUDA tensor calls the driver.
    torch._C._ensureCUDADeviceGuardSet()
    with simulated_cuda(monkeypatch, devices=devices, runtimes=(pack.vramcut_core.runtime,)) as s:
        monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("cuda", 0))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)   # 0.3.x's soft_empty_cache calls it
        # a CUDA host page-locks offloaded weights and leaves the pack room to (0.33+: its limit;
        # the CPU switch of the test process sets it to 0)
        from comfy.cli_args import args
        monkeypatch.setattr(args, "disable_pinned_memory", False, raising=False)
        if getattr(mm, "MAX_PINNED_MEMORY", None) is not None:
            monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 8 << 30)
            monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev=None: {   # the host's free-memory reading
            "active_bytes.all.current": s.alloc_of(dev).allocated,
            "reserved_bytes.all.current": s.alloc_of(dev).reserved})
        yield s
        gc.collect()   # masters page-locked in this simulator are let go inside it
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


def call(base, clone, inputs):
    """One step of the host's sampler: its ``apply_model`` with the patched model's wrappers."""
    x, sigma, conds = inputs
    return base.apply_model(x, sigma, transformer_options={"wrappers": clone.wrappers}, **conds)


def sampling(clone, steps: Callable):
    """A sampling run as the host runs one around its steps: OUTER_SAMPLE, ON_PRE_RUN .. ON_CLEANUP."""
    import comfy.patcher_extension as pe

    def run():
        clone.pre_run()
        clone.model.current_patcher = clone
        try:
            return steps()
        finally:
            clone.cleanup()

    outer = pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, {"transformer_options": {"wrappers": clone.wrappers}},
                                is_model_options=True)
    return pe.WrapperExecutor.new_class_executor(run, types.SimpleNamespace(model_patcher=clone), outer).execute()


@pytest.fixture
def forward_peaks(monkeypatch, pack):
    """Every executor forward metered (the CPU meter on steady forwards too): ``(peak, budget)``
    of each, the pack's own executor class as ComfyUI imports it."""
    SegmentedExecutor = pack.vramcut_core.runtime.executor.SegmentedExecutor
    seen, orig = [], SegmentedExecutor.forward

    def metered(self, plan, *a, **k):
        self.track_cpu_memory = True
        out = orig(self, plan, *a, **k)
        seen.append((out[1].peak_device_bytes, plan.budget_bytes))
        return out

    monkeypatch.setattr(SegmentedExecutor, "forward", metered)
    return seen
