"""The ComfyUI adapter: the only code of the pack that imports ``comfy``."""
from .max_vram import NODES, comfy_entrypoint

__all__ = ["NODES", "comfy_entrypoint"]
