"""ComfyUI tests: ComfyUI imported as a library on CPU, the pack imported as ComfyUI imports it
(a package named after its folder), so its relative imports are the ones ComfyUI runs."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import tiny_models as tm
from pack_nodes import run_node

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACK_NAME = "ComfyUI_VRAMCut"



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


def load_pack():
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    spec = importlib.util.spec_from_file_location(PACK_NAME, os.path.join(REPO, "__init__.py"),
                                                  submodule_search_locations=[REPO])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = pack
    spec.loader.exec_module(pack)
    return pack


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
