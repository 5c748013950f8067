"""VRAMCut for ComfyUI: one "Max VRAM" budget, kept by block-level segmented execution.

ComfyUI imports this folder as a package. The engine (``vramcut_core``) needs only torch; the
ComfyUI adapter (``nodes``) is imported only when ComfyUI is there, so the engine imports and
tests without the host.
"""
import importlib.util

WEB_DIRECTORY = "./web"

# ``__package__`` is empty when this file is imported as a plain module (pytest collecting from
# a checkout whose folder name is not a Python name, such as ComfyUI-VRAMCut): no nodes then.
if __package__ and importlib.util.find_spec("comfy") is not None:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
else:
    NODE_CLASS_MAPPINGS = {}
    NODE_DISPLAY_NAME_MAPPINGS = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
