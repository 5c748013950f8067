"""ComfyUI tests: ComfyUI imported as a library on CPU, the pack imported as ComfyUI imports it
(a package named after its folder), so its relative imports are the ones ComfyUI runs."""
from __future__ import annotations

import gc

import pytest

import tiny_models as tm
from pack_nodes import load_pack, run_node
from sim_cuda import simulated_cuda


@pytest.fixture(scope="session")
def comfy():
    try:
        return tm.import_comfy()
    except tm.ComfyUINotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def pack(comfy):
    return load_pack()


@pytest.fixture
def max_vram(pack):
    """Apply the Max VRAM node: ``max_vram(model=..., gb=...)`` -> (outputs, payload)."""

    def apply(gb, model=None, clip=None, vae=None, node_id="1", **kw):
        opts = dict(budget_mode="fixed", reserve_gb=1.0, prefetch=True, residency=True) | kw
        out, ui = run_node(pack, "VRAMCutMaxVRAM", node_id, max_vram_gb=gb, **opts,
                           model=model, clip=clip, vae=vae)
        return out, ui["vramcut"][0]

    return apply


# by the pinned-teardown and compiler tests and the GPU check's detach test.
# by the pinned-teardown, compiler and multi-GPU-free tests and the GPU check's detach test.

@pytest.fixture
def sim(monkeypatch, pack):
    with simulated_cuda(monkeypatch, runtimes=(pack.vramcut_core.runtime,)) as s:
        yield s
        gc.collect()
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


@pytest.fixture
def host_pins(comfy, pack, monkeypatch, link_figure):
    """The host's own page-locking on, its table empty; the pack's ledger with no cap of its own."""
    import comfy.model_management as mm
    import comfy.model_patcher
    from comfy.cli_args import args

    if not hasattr(comfy.model_patcher.ModelPatcher, "unpin_all_weights"):
        pytest.skip("this host does not page-lock offloaded weights itself")
    monkeypatch.setattr(args, "disable_pinned_memory", False, raising=False)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 8 << 30)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0)
    monkeypatch.setattr(mm, "PINNED_MEMORY", {})
    ledger = pack.vramcut_core.runtime.host_memory.PAGE_LOCKED
    monkeypatch.setattr(ledger, "room", None)
    monkeypatch.setattr(ledger, "bytes", 0)
    monkeypatch.setattr(ledger, "cap", -1)
    return mm


@pytest.fixture
def link_figure(monkeypatch, pack):
    """The node's answer line estimates a cost from the link's bandwidth: a figure given here (as
    a cached one), not measured on this machine."""
    monkeypatch.setattr(pack.vramcut_core.figures.bandwidth, "host_to_device",
                        lambda device, max_bytes=None: {"bytes_per_s": 25e9, "device": str(device), "source": "cache"})
