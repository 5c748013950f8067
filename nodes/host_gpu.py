"""The host's own use of page-locked memory, of recorded allocation graphs and of fast disks, as
far as the engines must follow it: whether the pack may pin (and how much the host's limit
leaves), whether the host streams a model from a fast disk (then the engine keeps file-backed
weights as their own masters), and the context that keeps the executor's allocations out of the
host's malloc graphs. Owns no memory; the one rule: the pack's pins stay within what the host
allows. May call ComfyUI's model_management and cli_args, and the engine's pin ledger.
"""
from __future__ import annotations

import contextlib
import importlib

import comfy.model_management as mm

from ..vramcut_core.runtime.host_memory import PINNED


def host_pinning() -> bool:
    """Whether the pack may page-lock host memory, within the host's own limit.

    Hosts that pin offloaded weights themselves (``comfy.model_management.MAX_PINNED_MEMORY``,
    newer releases) count what they pinned against a limit: the pack's own pins stay within
    what that limit leaves, and pin nothing where the host pins nothing (``--disable-pinned-
    memory``, or a device it does not pin for). Weights the host has already page-locked are
    copied from where they are, never registered again (the executor checks ``is_pinned``)."""
    from comfy.cli_args import args
    if getattr(args, "disable_pinned_memory", False):
        return False
    limit = getattr(mm, "MAX_PINNED_MEMORY", None)
    if limit is None:  # the host pins nothing itself (0.3.x): the executor's own cap applies
        return True
    if limit <= 0:
        return False
    PINNED.room = lambda: int(mm.MAX_PINNED_MEMORY - getattr(mm, "TOTAL_PINNED_MEMORY", 0)
                                              - PINNED.bytes)
    return True


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
