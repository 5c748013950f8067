"""The budget holds from the first step: the measuring forward stays within it (stopped and cut
finer rather than overrun), idle units neither size the window nor get blamed, errors say what
does not fit and the smallest budget that works, the verify switch, and a real out-of-memory
error inside a segment."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from toys import MLPBlock, TransformerStack, assert_unchanged, seeded, snapshot
from unit_checks import assert_peak_within_budget
from vramcut_core import BudgetError, Engine, EngineConfig, PlanUnit, build_plan, find_units, make_plan
from vramcut_core.model.units import split_unit


def ids(b=2, n=12, vocab=50, seed=0):
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def probe(model, fn, *args):
    """Activation reserve and the largest unit's device bytes, from a forward at a huge budget."""
    e = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    with torch.no_grad():
        e.run(fn, *args)
    biggest = max(e.executor.unit_device_bytes(u.name) for u in e.unitset.units if not u.keep_resident)
    return e.last_plan.activation_reserve_bytes, biggest


# ------------------------------------------------------------------------------------------------
# 1. the measuring forward stays within the budget


def no_dry_run(monkeypatch):
    """The fallback path: the dry run reports that it could not run (as for a data-dependent op)."""
    from vramcut_core import engine
    from vramcut_core.figures.trace import TraceResult

    monkeypatch.setattr(engine, "trace_units", lambda *a, **k: TraceResult(None, reason="off in this test"))


def test_first_forward_peak_is_within_a_budget_the_whole_unit_slot_would_pass(caplog, monkeypatch):
    """Budget below (largest unit + activations), no dry run: a measuring forward with one slot of
    the largest uncut unit would pass it. It is stopped before that, cut finer and run again: the
    first forward's measured peak is within the budget, the output exact, later forwards too."""
    no_dry_run(monkeypatch)
    model = seeded(TransformerStack(d=64, depth=4))
    x = ids(b=16, n=64)
    act, biggest = probe(model, model, x)
    budget = act + int(biggest * 0.75)
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", track_cpu_memory=True))
        with caplog.at_level(logging.INFO, logger="vramcut"), eng.session():
            out = eng.run(model, x)
            first = eng.last_stats
            outs = [eng.run(model, x) for _ in range(2)]
    assert torch.equal(out, ref) and all(torch.equal(o, ref) for o in outs)
    assert first.peak_device_bytes > 0 and first.peak_device_bytes <= budget, \
        f"first forward peak {first.peak_device_bytes} over budget {budget}"
    assert_peak_within_budget(eng)
    assert any("stopped before passing the budget" in r.getMessage() for r in caplog.records), \
        "the budget should have forced a stop and a finer cut"
    assert eng.last_plan.split, "the plan cuts blocks finer"
    assert eng.last_plan.peak_bytes <= budget
    assert_unchanged(model, snap)
    assert eng.executor.device_bytes == 0


@pytest.mark.parametrize("share", [1.3, 2.0, 4.0])
def test_first_forward_within_budget_at_several_budgets(share):
    model = seeded(TransformerStack(d=48, depth=3))
    x = ids(b=8, n=32)
    act, biggest = probe(model, model, x)
    budget = act + int(biggest * share)
    with torch.no_grad():
        ref = model(x)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu"))
        out = eng.run(model, x)
    assert torch.equal(out, ref)
    assert_peak_within_budget(eng.last_stats, budget)


def test_activations_that_cannot_fit_stop_the_forward_with_a_clear_error():
    model = seeded(TransformerStack(d=32, depth=3))
    x = ids(b=16, n=64)
    act, biggest = probe(model, model, x)
    budget = act // 2
    assert budget > 3 * biggest, "weights must fit so that activations are what does not"
    snap = snapshot(model)
    eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu"))
    with pytest.raises(BudgetError) as e, torch.no_grad():
        eng.run(model, x)
    assert e.value.kind == "activations"
    msg = str(e.value)
    assert "activations" in msg and "smallest max_vram_gb" in msg and "input shape" in msg
    assert e.value.min_budget_bytes > budget
    assert_unchanged(model, snap)
    assert eng.executor.device_bytes == 0
    with pytest.raises(BudgetError):  # the same shape fails the same way, without running again
        eng.run(model, x)


# ------------------------------------------------------------------------------------------------
# 2. units a forward never runs


class EncDec(nn.Module):
    """An encoder that cannot be cut (one wide layer) and a decoder of blocks; ``decode`` runs
    the decoder only, as a VAE decode does."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"down": nn.ModuleList([nn.Linear(256, 256)])})
        self.decoder = nn.ModuleList(MLPBlock(32) for _ in range(4))

    def decode(self, x):
        for b in self.decoder:
            x = b(x)
        return x


def test_an_idle_unit_larger_than_the_budget_neither_sizes_the_window_nor_is_blamed():
    model = seeded(EncDec())
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    enc = sum(p.numel() * 4 for p in model.encoder.parameters())
    act, _ = probe(model, model.decode, x)
    dec_block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.decoder)
    budget = act + 3 * dec_block + 8192
    assert budget < enc
    with torch.no_grad():
        ref = model.decode(x)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu"))
        out = eng.run(model.decode, x)
    assert torch.equal(out, ref)
    plan = eng.last_plan
    assert plan.slot_bytes < enc and plan.peak_bytes <= budget
    assert_peak_within_budget(eng.last_stats, budget)
    idle = [u.name for u in plan.units if not u.entered]
    assert idle and all("decoder" not in n for n in idle)


def test_slot_is_sized_over_entered_units_only():
    units = [PlanUnit("encoder", 200, 0, 0, entered=False)] + \
            [PlanUnit(f"decoder.{i}", 20, 10, 5) for i in range(4)]
    plan = build_plan(units, 60)
    assert plan.slot_bytes == 20 and plan.peak_bytes <= 60
    assert "encoder" not in plan.resident_units and "encoder" not in plan.streamed_order


def test_error_names_activations_when_they_are_what_does_not_fit():
    units = [PlanUnit("enc", 500, 0, 0, entered=False)] + [PlanUnit(f"dec.{i}", 10, 100, 50) for i in range(3)]
    with pytest.raises(BudgetError) as e:
        make_plan(units, 80)
    assert e.value.kind == "activations" and "enc'" not in str(e.value)
    assert "activations need" in str(e.value) and e.value.min_budget_bytes == 10 + 100
    with pytest.raises(BudgetError) as e:
        make_plan([PlanUnit("big", 300, 10, 5), PlanUnit("small", 10, 10, 5)], 100)
    assert e.value.kind == "weights" and "'big'" in str(e.value) and e.value.min_budget_bytes == 310


class Down(nn.Module):
    """A down block whose only child is the container of its blocks (as ``encoder.down.3``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(MLPBlock(d) for _ in range(2))

    def forward(self, x):
        for b in self.block:
            x = b(x)
        return x


class DownStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList(Down(16) for _ in range(3))

    def forward(self, x):
        for d in self.down:
            x = d(x)
        return x


def test_split_unit_descends_through_a_single_container_child():
    from vramcut_core.model.units import TensorRef, Unit, UnitTensor

    m = DownStack()
    down = m.down[2]
    tensors = [UnitTensor(t, [TensorRef(mod, k, True, f"down.2.{q}.{k}")])
               for q, mod in down.named_modules() for k, t in mod._parameters.items() if t is not None]
    unit = Unit("down.2", "block", [("down.2", down)], tensors)
    parts = split_unit(unit)
    assert parts is not None
    assert [p.name for p in parts] == ["down.2.block.0", "down.2.block.1"]
    assert sum(p.weight_bytes for p in parts) == unit.weight_bytes


# ------------------------------------------------------------------------------------------------
# 4. the verify switch


def test_verify_compares_each_new_shape_with_the_unpatched_forward(caplog):
    model = seeded(TransformerStack(d=32, depth=4))
    act, biggest = probe(model, model, ids())
    eng = Engine(model, EngineConfig(budget_bytes=act + 3 * biggest, device="cpu", verify=True))
    with caplog.at_level(logging.WARNING, logger="vramcut"), torch.no_grad():
        eng.run(model, ids())
        eng.run(model, ids())
        eng.run(model, ids(b=3))
    assert len(eng.verify_results) == 2, "once per new shape"
    assert all(r["max_abs_diff"] == 0.0 and r["equal"] and r["error"] is None for r in eng.verify_results)
    assert sum("max |segmented - unpatched| = 0" in r.getMessage() for r in caplog.records) == 2
    assert eng.describe()["verify"] == eng.verify_results
    assert eng.describe()["text"].count("max |segmented - unpatched| = 0") == 2


def test_verify_is_off_by_default_and_on_with_the_environment_variable(monkeypatch):
    monkeypatch.delenv("VRAMCUT_VERIFY", raising=False)
    assert EngineConfig(budget_bytes=1 << 20).verify is False
    monkeypatch.setenv("VRAMCUT_VERIFY", "1")
    assert EngineConfig(budget_bytes=1 << 20).verify is True
    model = seeded(TransformerStack(d=16, depth=2))
    eng = Engine(model, EngineConfig(budget_bytes=1 << 30, device="cpu"))
    with torch.no_grad():
        eng.run(model, ids())
    assert [r["equal"] for r in eng.verify_results] == [True]


# ------------------------------------------------------------------------------------------------
# 5. a real out-of-memory error inside a segment


class OOMBlock(MLPBlock):
    armed = False

    def forward(self, x):
        y = self.fc1(self.norm(x))
        if self.armed:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x + self.fc2(torch.nn.functional.gelu(y))


def test_out_of_memory_inside_a_segment_releases_everything_and_the_next_run_works():
    model = seeded(TransformerStack(d=32, depth=4))
    model.blocks[2] = seeded(OOMBlock(32), seed=3)
    x = ids()
    act, biggest = probe(model, model, x)
    budget = act + 3 * biggest
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", track_cpu_memory=True))
        with eng.session():
            assert torch.equal(eng.run(model, x), ref)
            model.blocks[2].armed = True
            with pytest.raises(torch.OutOfMemoryError) as e:
                eng.run(model, x)
            assert eng.executor.device_bytes == 0, "an out-of-memory error releases every buffer"
            assert_unchanged(model, snap)
            model.blocks[2].armed = False
            assert torch.equal(eng.run(model, x), ref), "the next run works"
    msg = str(e.value)
    assert "blocks.2" in msg and "segment" in msg and "budget" in msg and "B" in msg
    assert "Tried to allocate 2.00 GiB" in msg
    assert_unchanged(model, snap)
    assert_peak_within_budget(eng)
    assert not any(m._forward_pre_hooks for m in model.modules()), "no hook left behind"
