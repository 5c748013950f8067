"""The ComfyUI adapter: the only code of the pack that imports ``comfy``."""
from .max_vram import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
