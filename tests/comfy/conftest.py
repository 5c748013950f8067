"""ComfyUI tests: ComfyUI imported as a library on CPU, the pack imported as ComfyUI imports it
(a package named after its folder), so its relative imports are the ones ComfyUI runs."""
from __future__ import annotations

import pytest

import tiny_models as tm
from pack_nodes import load_pack, run_node


@pytest.fixture(scope="session", autouse=True)
def _bandwidth_cache(tmp_path_factory):
    """The node measures the host-to-device bandwidth once and caches it: here, not in the home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VRAMCUT_CACHE_DIR", str(tmp_path_factory.mktemp("vramcut_cache")))
    yield
    mp.undo()


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
