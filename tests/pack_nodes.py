"""Run the pack's nodes the way ComfyUI runs them: found through the V3 entry point, executed
through the host's own normalising call on a class clone that holds the hidden inputs."""
from __future__ import annotations

import asyncio


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
