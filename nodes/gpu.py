"""The host's own use of the GPU, as far as the engines must follow it: its offload streams
(which may read weights the engine has swapped in), its page-locked memory (whether the pack may
page-lock, and how much the host's limit leaves), its recorded allocation graphs (kept out of the
engine's allocations), fast disks (the engine then keeps file-backed weights as their own
masters), in-place weight writes (hook LoRAs) and the memory the engines hold that the host
counts as used. ``host_hooks`` gathers what an engine is given at construction.

ComfyUI 0.3.64 with async offload casts every weight on an offload stream, even one already on
the device; later releases take one only for weights not on the device. Either way each of the
host's offload streams is ordered after the engine's copies (``HostHooks.reader_streams``), so
no release can read a weight before its copy has landed. Features are found by presence.

Owns no memory; the one rule: the pack's page-locked bytes stay within what the host allows.
May call ComfyUI's model_management, model_prefetch and cli_args, and the engine's public face.
"""
from __future__ import annotations

import contextlib
import importlib

import torch

import comfy.model_management as mm

from ..vramcut_core import HostHooks


def may_page_lock() -> bool:
    """Whether the pack may page-lock host memory at all (a question; nothing is installed).

    Hosts that pin offloaded weights themselves (``comfy.model_management.MAX_PINNED_MEMORY``,
    newer releases) count what they pinned against a limit: the pack's own page-locked bytes
    stay within what that limit leaves (``page_lock_room``), and the pack page-locks nothing
    where the host pins nothing (``--disable-pinned-memory``, or a device it does not pin for).
    Weights the host has already page-locked are copied from where they are, never registered
    again (the engine checks ``is_pinned``)."""
    from comfy.cli_args import args
    if getattr(args, "disable_pinned_memory", False):
        return False
    limit = getattr(mm, "MAX_PINNED_MEMORY", None)
    return limit is None or limit > 0  # None: the host pins nothing itself (0.3.x): the engine's cap applies


def page_lock_room():
    """The host's page-lock room for the engines (``HostHooks.page_lock_room``): a function
    giving the bytes the host's limit leaves after what the host pinned itself, read at each
    page-lock; None on hosts without such a limit."""
    if getattr(mm, "MAX_PINNED_MEMORY", None) is None:
        return None
    return lambda: int(mm.MAX_PINNED_MEMORY - getattr(mm, "TOTAL_PINNED_MEMORY", 0))


def host_fast_disk(patcher) -> bool:
    """Whether the host streams this model's weights from a fast disk rather than holding them in
    RAM. ComfyUI 0.38 decides it per model (``ModelPatcher(..., fast_disk=...)``, from where the
    loader's file lies, ``--fast-disk`` / ``--disable-fast-disk`` applied; ``clone()`` passes it
    on); 0.33 has only the process-wide ``--fast-disk``; 0.3.x neither (False)."""
    decided = getattr(patcher, "fast_disk", None)
    if decided is not None:
        return bool(decided)
    from comfy.cli_args import args
    return bool(getattr(args, "fast_disk", False)) and not getattr(args, "disable_fast_disk", False)


def host_allocation_pause():
    """The host's context that keeps allocations out of its recorded allocation graphs (newer
    ComfyUI: ``comfy.model_prefetch.pause_malloc_graph``), or a no-op on hosts without them."""
    try:
        prefetch = importlib.import_module("comfy.model_prefetch")
    except ImportError:
        return contextlib.nullcontext
    return getattr(prefetch, "pause_malloc_graph", None) or contextlib.nullcontext


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


def host_hooks(device) -> HostHooks:
    """What an engine on ``device`` is given of the host: its allocation pause, its offload
    streams (ordered after the engine's copies) and its page-lock room."""
    dev = torch.device(device)
    streams = (lambda: offload_streams(dev)) if dev.type == "cuda" else None
    return HostHooks(alloc_context=host_allocation_pause(), reader_streams=streams,
                     page_lock_room=page_lock_room())


def weights_changing(state) -> None:
    """The host is about to write into the weights in place (``patch_hooks``): every engine
    waits for copies reading them and copies what it holds again at its next forward."""
    for e in state.engines():
        e.weights_changed()


def held_on(state, device) -> int:
    """Device bytes the engines of a patch hold between forwards on ``device`` (a device without
    an index: the current one of its type)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return 0
    if dev.index is None and dev.type == "cuda" and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return sum(n for e in state.engines() for d, n in e.held_bytes_by_device.items() if torch.device(d) == dev)


def held_bytes(state) -> int:
    """Device bytes the engines of a patch hold between forwards (weights the host counts as
    used memory when it decides whether cond and uncond fit in one batch)."""
    return sum(e.held_bytes for e in state.engines())
