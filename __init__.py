"""VRAMCut for ComfyUI: one "Max VRAM" budget, kept by block-level segmented execution.

ComfyUI imports this folder as a package and registers its nodes through the V3 entry point
``comfy_entrypoint`` (ComfyUI reads V1 ``NODE_CLASS_MAPPINGS`` first and then ignores the entry
point, so this module never defines them). The engine (``vramcut_core``) needs only torch; the
ComfyUI adapter (``nodes``) is imported only when ComfyUI is there, so the engine imports and
tests without the host.
"""
import importlib.util

WEB_DIRECTORY = "./web"

# ``__package__`` is empty when this file is imported as a plain module (pytest collecting from
# a checkout whose folder name is not a Python name, such as ComfyUI-VRAMCut): no nodes then.
if __package__ and importlib.util.find_spec("comfy") is not None:
    from .nodes import comfy_entrypoint

    __all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
else:
    __all__ = ["WEB_DIRECTORY"]
