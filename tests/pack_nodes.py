"""Load the pack and run its nodes the way ComfyUI does: the pack imported as a package named
after its folder (so its relative imports are the ones ComfyUI runs), its nodes found through
the V3 entry point and executed through the host's own normalising call on a class clone that
holds the hidden inputs."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK_NAME = "ComfyUI_VRAMCut"


def load_pack():
    """The pack as ComfyUI imports it (ComfyUI must be importable first)."""
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    spec = importlib.util.spec_from_file_location(PACK_NAME, os.path.join(REPO, "__init__.py"),
                                                  submodule_search_locations=[REPO])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = pack
    spec.loader.exec_module(pack)
    return pack


def node_classes(pack) -> dict:
    """``{node_id: class}`` for the nodes the pack's ``comfy_entrypoint`` lists."""
    async def listed():
        return await (await pack.comfy_entrypoint()).get_node_list()

    return {c.GET_SCHEMA().node_id: c for c in asyncio.run(listed())}


def run_node(pack, node_id: str, unique_id: str = "1", **inputs):
    """``(outputs, ui)`` of one execution of ``node_id`` with ``inputs`` given by name."""
    from comfy_api.latest import io

    cls = node_classes(pack)[node_id]
    # ComfyUI executes a shallow clone of the class carrying ``hidden``; a subclass does the same
    # without the host's clone helper, whose signature differs between releases.
    bound = type(cls.__name__, (cls,), {"hidden": io.HiddenHolder.from_dict({io.Hidden.unique_id: unique_id})})
    out = getattr(bound, bound.FUNCTION)(**inputs)
    return tuple(out.args), out.ui
