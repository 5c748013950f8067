"""The adapter's user-facing errors, apart so that every nodes module can raise them without an
import cycle. Owns nothing; may call torch only."""
from __future__ import annotations

import torch


class VRAMCutError(ValueError):
    """A user-facing problem with the node's inputs."""


class VRAMCutOOM(torch.cuda.OutOfMemoryError):
    """Raised when the budget cannot hold a call's activations, so that ComfyUI's own
    out-of-memory fallbacks (tiled VAE decode/encode, smaller upscale tiles) take over."""


# ComfyUI names an exception by its module path, and this pack's modules are named after its
# folder ("ComfyUI-VRAMCut.nodes.errors.VRAMCutError" in the error panel): read as a name instead.
for _cls in (VRAMCutError, VRAMCutOOM):
    _cls.__module__ = "vramcut"
