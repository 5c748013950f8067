"""Refusals with devices name each device's own smallest budget, in the Devices node's form.

An engine given devices (``EngineConfig.devices``) replaces ``max_vram_gb`` with one budget per
device: every refusal it makes (the weights-only plan drawn before a run, a first call too small,
one device named alone) says ``cuda:0=…, cuda:1=…`` and never ``max_vram_gb``; the budgets given
are written rounded down, so a budget refused never reads as the smallest that works.
"""
from __future__ import annotations

import gc
import re

import pytest
import torch

from sim_cuda import simulated_cuda
from test_sim_multi_gpu import setup
from vramcut_core import BudgetError, Engine, EngineConfig, gib_text, gib_to_bytes
from vramcut_core.planning.placement import devices_error

FORM = re.compile(r"cuda:0=([0-9.]+), cuda:1=([0-9.]+)")


@pytest.fixture
def sim2(monkeypatch):
    with simulated_cuda(monkeypatch, devices=2) as s:
        yield s
        gc.collect()


def _engine(model, devs):
    return Engine(model, EngineConfig(budget_bytes=sum(b for _, b in devs), device="cuda:0", devices=tuple(devs)))


def _in_devices_form(err: BudgetError, devs) -> None:
    msg = str(err)
    assert "max_vram_gb" not in msg, msg
    assert err.device_budgets is not None and [d for d, _ in err.device_budgets] == [d for d, _ in devs]
    per = ", ".join(f"{d}={gib_text(b)}" for d, b in err.device_budgets)
    assert per in msg, msg


def test_the_weights_only_refusal_names_each_device(sim2):
    """The plan drawn before a run, from weights alone, at budgets below one tensor's bytes."""
    model, args, _ = setup(sim2, "video")
    devs = [("cuda:0", 1000), ("cuda:1", 1000)]
    with pytest.raises(BudgetError) as e:
        _engine(model, devs).weight_plan()
    _in_devices_form(e.value, devs)
    assert not e.value.exact and "at least" in str(e.value)


def test_the_first_calls_refusal_names_each_device(sim2):
    model, args, _ = setup(sim2, "video")
    devs = [("cuda:0", 40_000), ("cuda:1", 40_000)]
    with torch.no_grad(), pytest.raises(BudgetError) as e:
        _engine(model, devs).run(model, *args)
    _in_devices_form(e.value, devs)
    assert sim2.allocs[1].high_allocated == 0


def test_one_device_named_in_devices_is_refused_naming_it(sim2):
    model, args, _ = setup(sim2, "video")
    devs = [("cuda:0", 10_000)]
    eng = Engine(model, EngineConfig(budget_bytes=10_000, device="cuda:0", devices=tuple(devs)))
    with torch.no_grad(), pytest.raises(BudgetError) as e:
        eng.run(model, *args)
    _in_devices_form(e.value, devs)
    assert "smallest budget that works for this shape is cuda:0=" in str(e.value)
    with pytest.raises(BudgetError) as e:
        Engine(model, EngineConfig(budget_bytes=1000, device="cuda:0", devices=(("cuda:0", 1000),))).weight_plan()
    _in_devices_form(e.value, [("cuda:0", 1000)])


@pytest.mark.parametrize("given,smallest", [("0.0012", "0.0015"), ("0.0019", "0.00191"), ("0.00002", "0.0005")])
def test_a_budget_given_never_reads_as_the_smallest(given, smallest):
    """The budgets given are rounded down, the smallest that work up: 0.0012 GiB refused reads
    "0.001", the smallest "0.002" (not both "0.002")."""
    devs = [("cuda:0", gib_to_bytes(given)), ("cuda:1", gib_to_bytes(given))]
    sug = [("cuda:0", gib_to_bytes(smallest)), ("cuda:1", gib_to_bytes(smallest))]
    msg = str(devices_error(devs, sug, exact=True))
    (g0, g1), (s0, s1) = FORM.findall(msg)
    assert g0 == g1 and s0 == s1 == gib_text(sug[0][1])
    assert float(g0) < float(s0) and gib_to_bytes(g0) <= devs[0][1], msg
