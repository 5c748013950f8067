"""Host pinning: the pack page-locks host memory only where, and as much as, the host allows.

Newer hosts pin offloaded weights themselves against a limit (``MAX_PINNED_MEMORY``, counted in
``TOTAL_PINNED_MEMORY``); ``--disable-pinned-memory`` turns that off. The pack follows: its own
pins fit in what the host's limit leaves, none where the host pins none. (That weights the host
already page-locked are copied from where they are, never registered again, is a simulated-CUDA
test: ``tests/core/test_sim_cuda.py``.)"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def host(comfy, pack, monkeypatch):
    import comfy.model_management as mm
    from comfy.cli_args import args

    ledger = pack.vramcut_core.runtime.host_memory.PAGE_LOCKED
    monkeypatch.setattr(ledger, "room", None)
    monkeypatch.setattr(ledger, "bytes", 0)
    monkeypatch.setattr(ledger, "cap", -1)  # no RAM cap of the pack's own: the host's limit alone
    return mm, args, ledger, pack.nodes.gpu


def _engine_given(pack, hooks):
    """An engine built as the adapter builds one, with the host's hooks (which set the ledger's room)."""
    core = pack.vramcut_core
    return core.Engine(torch.nn.Linear(2, 2), core.EngineConfig(budget_bytes=1 << 20, device="cpu"), host=hooks)


def test_disable_pinned_memory_turns_off_the_packs_pinning(host, monkeypatch):
    mm, args, ledger, h = host
    monkeypatch.setattr(args, "disable_pinned_memory", True, raising=False)
    assert h.may_page_lock() is False


def test_pins_stay_within_what_the_hosts_limit_leaves(host, monkeypatch, pack):
    mm, args, ledger, h = host
    monkeypatch.setattr(args, "disable_pinned_memory", False, raising=False)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1000, raising=False)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 700, raising=False)
    assert h.may_page_lock() is True
    assert ledger.room is None, "asking installs nothing"
    _engine_given(pack, h.host_hooks("cpu"))
    assert ledger.allows(300) and not ledger.allows(301)
    ledger.bytes = 200  # the pack's own pins count too
    assert ledger.allows(100) and not ledger.allows(101)
    mm.TOTAL_PINNED_MEMORY = 1000  # the host used it all
    assert not ledger.allows(1)


def test_no_pins_where_the_host_pins_none(host, monkeypatch):
    mm, args, ledger, h = host
    monkeypatch.setattr(args, "disable_pinned_memory", False, raising=False)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", -1, raising=False)
    assert h.may_page_lock() is False


def test_engines_follow_the_host(host, monkeypatch, max_vram, pack):
    import tiny_models as tm
    mm, args, ledger, h = host
    monkeypatch.setattr(args, "disable_pinned_memory", True, raising=False)
    (patched, _, _), _ = max_vram(0.01, model=tm.load_tiny_sd3(depth=2))
    (engine,) = pack.nodes.patcher.state_of(patched).engines()
    assert engine.config.pin_memory is False


def test_hosts_without_their_own_pinning_leave_the_packs_cap(host, monkeypatch, pack):
    mm, args, ledger, h = host
    if hasattr(mm, "MAX_PINNED_MEMORY"):
        monkeypatch.delattr(mm, "MAX_PINNED_MEMORY")
    monkeypatch.setattr(args, "disable_pinned_memory", False, raising=False)
    assert h.may_page_lock() is True and h.page_lock_room() is None
    _engine_given(pack, h.host_hooks("cpu"))
    assert ledger.room is None
