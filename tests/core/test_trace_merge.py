"""A host's hook on each fresh device copy (``Engine.run(..., on_loaded=...)``: ComfyUI's LoRA
merge, which dequantises a weight, adds the patch's delta and quantises the result again) in the
dry run and the measuring forward. The dry run runs the hook on its fakes, so the number a
refusal names holds the hook's temporaries: that budget runs the traced plan (no forward passes
it and is measured again), a byte less is refused, also where the budget cuts a block finer and
a part merges its weights beside what the block computed before it. A stop of the measuring
forward that the host's own code catches (ComfyUI logs and skips a patch that raises) still
stops it: the live bytes it saw stay counted, so the next allocation stops it again, and its
output is never returned."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from test_trace import GeluMLP
from toys import assert_unchanged, seeded, snapshot
from vramcut_core import BudgetError, Engine, EngineConfig
from vramcut_core.figures.trace import TRACED
from vramcut_core.runtime.executor import SegmentedExecutor

RANK = 4


class Stack(nn.Module):
    def __init__(self, d: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(GeluMLP(d) for _ in range(depth))  # cut finer into fc1, fc2
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class Merge:
    """The host's merge of a low-rank patch into each block weight's device copy, the way
    ComfyUI merges a LoRA into a quantized weight: the weight widened (dequantised), the delta
    made from its two factors, the sum narrowed back into the copy. With ``swallow`` it catches
    any error and leaves the weight unpatched, as ComfyUI's ``calculate_weight`` does."""

    def __init__(self, model: nn.Module, swallow: bool = False) -> None:
        g = torch.Generator().manual_seed(7)
        self.factors = {n: (torch.randn(p.shape[0], RANK, generator=g) * 0.05, torch.randn(RANK, p.shape[1], generator=g))
                        for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
        self.swallow, self.skipped = swallow, []

    def patched(self, name: str, w: torch.Tensor) -> torch.Tensor:
        a, b = self.factors[name]
        return (w.double() + (a @ b).to(w.device, torch.float64)).float()

    def __call__(self, unit) -> None:
        for ut in unit.tensors:
            name = ut.refs[0].qualname
            if name not in self.factors:
                continue
            live = ut.refs[0].get()
            try:
                live.data.copy_(self.patched(name, live.data))
            except Exception as e:  # noqa: BLE001 (the host's own catch-all)
                if not self.swallow:
                    raise
                self.skipped.append((name, type(e).__name__))

    def reference(self, model: nn.Module) -> nn.Module:
        import copy
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n in self.factors:
                    p.copy_(self.patched(n, p))
        return ref


def _case(d=64, depth=4, tokens=96):
    model = seeded(Stack(d, depth))
    x = torch.randn(2, tokens, 8, generator=torch.Generator().manual_seed(1))
    merge = Merge(model)
    with torch.no_grad():
        ref, plain = merge.reference(model)(x), model(x)
    assert not torch.equal(ref, plain), "the patch must matter"
    return model, x, merge, ref


@pytest.fixture
def forwards(monkeypatch):
    calls = []
    orig = SegmentedExecutor.forward

    def counted(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    monkeypatch.setattr(SegmentedExecutor, "forward", counted)
    return calls


def _refusal(model, x, merge, budget):
    with pytest.raises(BudgetError) as e, torch.no_grad():
        Engine(model, EngineConfig(budget_bytes=budget, device="cpu")).run(model, x, on_loaded=merge)
    return e.value


@pytest.mark.parametrize("tokens", [96, 4])
def test_the_number_holds_the_hooks_temporaries_and_runs_the_traced_plan(tokens, forwards, caplog):
    """``tokens`` 4: activations are small beside the weights, the smallest budget cuts blocks
    finer, and ``fc2`` merges its weights at its own entry, beside what ``fc1`` computed."""
    model, x, merge, ref = _case(tokens=tokens)
    snap = snapshot(model)
    err = _refusal(model, x, merge, 1024)
    assert err.exact and "at least" not in str(err), str(err)
    assert not forwards, "refused by the dry run, before any forward"
    need = err.min_budget_bytes
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="vramcut"):
        eng = Engine(model, EngineConfig(budget_bytes=need, device="cpu", track_cpu_memory=True))
        with eng.session():
            outs = [eng.run(model, x, on_loaded=merge) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs), "every forward patched once, exactly"
    assert not [r.getMessage() for r in caplog.records if "passed the traced plan" in r.getMessage()]
    plan = eng.last_plan
    assert plan.source == TRACED and plan.streamed_bytes_per_forward > 0
    assert 0 < eng.stats.peak_device_bytes <= need, (eng.stats.peak_device_bytes, need)
    if tokens == 4:
        assert plan.split, "the smallest budget cuts a block finer"
    assert _refusal(model, x, merge, need - 1).min_budget_bytes == need
    assert_unchanged(model, snap)


def test_a_stop_the_host_catches_still_stops_the_measuring_forward(monkeypatch):
    """No dry run (the measuring forward is the first): the stop is raised inside the hook, whose
    catch-all leaves the weight unpatched; the forward must not return that output."""
    from vramcut_core import engine
    from vramcut_core.figures.trace import TraceResult

    monkeypatch.setattr(engine, "trace_units", lambda *a, **k: TraceResult(None, reason="off in this test"))
    model, x, _, ref = _case()
    merge = Merge(model, swallow=True)
    budget = 1024   # the numbers followed to one that runs without the hook (each a lower bound)
    for _ in range(8):
        try:
            with torch.no_grad():
                Engine(model, EngineConfig(budget_bytes=budget, device="cpu")).run(model, x)
            break
        except BudgetError as e:
            budget = e.min_budget_bytes
    budget += 16 * 1024   # short of the merge's temporaries
    snap = snapshot(model)
    eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu"))
    try:
        with torch.no_grad():
            out = eng.run(model, x, on_loaded=merge)
    except BudgetError as e:
        assert "at least" in str(e)
    else:
        assert torch.equal(out, ref), f"an output with patches skipped: {merge.skipped}"
    assert merge.skipped, "the scenario needs a stop inside the hook"
    assert_unchanged(model, snap)
