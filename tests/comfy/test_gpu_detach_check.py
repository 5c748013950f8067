"""``bench/gpu_check.py``'s ``detach`` check (a detach during sampling on a host that page-locks
the offloaded weights itself), small, on the simulated accelerator with the host's own pinning:
it runs through the pack's node, its verdict holds, and it fails where the host's unpin is not
deferred. Hosts without their own pinning (0.3.6x) skip, as the check itself does."""
from __future__ import annotations

import gc
import json
import os
import sys

import pytest
import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))
import gpu_detach_check  # noqa: E402
from sim_cuda import simulated_cuda  # noqa: E402

GIB = 1 << 30


def _scenario(pack, sim):
    return gpu_detach_check.scenario(pack, torch.device("cuda"), d=32, depth=6, room_bytes=96 << 10,
                                     inputs_on=torch.device("cpu"), host=sim.host_memory, on_device=sim.is_device)


def test_detach_check_runs_on_the_simulated_accelerator(sim, host_pins, pack):
    res = _scenario(pack, sim)
    assert res["ok"], json.dumps(res)
    assert res["detached_inside_a_forward"] and res["pinned_by_host_at_load"] == res["weights"]
    assert res["bit_equal_to_plain"]


def test_detach_check_fails_where_the_hosts_unpin_runs_inside_the_forward(host_pins, pack, monkeypatch):
    """Without the deferral (the host's own ``unpin_all_weights`` at once), the check says so."""
    import comfy.model_patcher

    base = comfy.model_patcher.ModelPatcher
    ours = [c for c in base.__subclasses__() if c.__module__.startswith(pack.__name__ + ".")
            and "unpin_all_weights" in vars(c)]
    assert ours, "the pack's patcher defers the host's unpin"
    for cls in ours:
        monkeypatch.setattr(cls, "unpin_all_weights", base.unpin_all_weights)
    with simulated_cuda(monkeypatch, runtimes=(pack.vramcut_core.runtime,)) as sim:
        res = _scenario(pack, sim)
        gc.collect()   # (the registrations the host leaves are this run's hazards: not checked here)
    assert not res["ok"], res
    assert res["unpin_warnings"] and res["host_pins_left"] and res["page_locked_left"], res
