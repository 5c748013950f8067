"""What the engine needs to know about the host's own use of the GPU, kept apart from the rest of
the adapter: the host's offload streams (which may read weights the engine has swapped in), the
host writing into weights in place (hook LoRAs), and the memory the engine holds that the host
counts as used.

ComfyUI 0.3.64 with async offload casts every weight on an offload stream, even one already on
the device; later releases take one only for weights not on the device. Either way each of the
host's offload streams is ordered after the engine's copies (``Engine.order_streams``), so no
release can read a weight before its copy has landed. Features are found by presence.
"""
from __future__ import annotations

import torch

import comfy.model_management as mm


def offload_streams(device) -> list:
    """The host's offload streams for ``device`` (made now if the host would make them, so
    that none appears mid-forward unordered); empty when the host uses none."""
    streams = getattr(mm, "STREAMS", None)
    get = getattr(mm, "get_offload_stream", None)
    if not isinstance(streams, dict) or get is None:
        return []
    dev = torch.device(device)
    if dev.type != "cuda":
        return []
    if dev not in streams:
        try:
            get(dev)
        except Exception:
            return []
    return list(streams.get(dev, ()))


def attach(engine, device) -> None:
    """Order the host's offload streams after the engine's copies."""
    if torch.device(device).type == "cuda":
        engine.order_streams(lambda: offload_streams(device))


def weights_changing(state) -> None:
    """The host is about to write into the weights in place (``patch_hooks``): every engine
    waits for copies reading them and copies what it holds again at its next forward."""
    for e in list(getattr(state, "_engines", {}).values()):
        e.weights_changed()


def held_bytes(state) -> int:
    """Device bytes the engines of a patch hold between forwards (weights the host counts as
    used memory when it decides whether cond and uncond fit in one batch)."""
    return sum(e.held_bytes for e in list(getattr(state, "_engines", {}).values()))
