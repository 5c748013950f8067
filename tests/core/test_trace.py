"""The dry run (vramcut_core.figures.trace): per-unit activation figures from fake tensors, compared with
the CPU meter's measured forward unit by unit (temporaries inside one module included); the
model untouched however the dry run ends; the fallback when a forward cannot be traced (the
number is then a lower bound, "at least"); a budget too small refused before any forward with
the smallest budget that works, exact to the byte; the pure minimum-budget search."""
from __future__ import annotations

import logging
import random
import time

import pytest
import torch
from torch import nn

from toys import (BufferedStack, ExplodingStack, FluxLike, MixedDtypeStack, QuantStack, TiedStack,
                  TransformerStack, UNetLike, assert_unchanged, seeded, snapshot)
from vramcut_core import BudgetError, Engine, EngineConfig, PlanOptions, PlanUnit, gib_to_bytes, make_plan
from vramcut_core.runtime.executor import SegmentedExecutor
from vramcut_core.planning.budget import gib_text
from vramcut_core.planning.plan import min_budget
from vramcut_core.figures.trace import MEASURED, TRACED, trace_units

# Traced figures are an upper bound of the measured ones and at most this much above (the family
# table compares them). On CPU both count the same storages, so they agree to the byte on these
# toys; the allowance is for storages the CPU meter cannot see (a tensor built from a Python
# list never passes through an operator that allocates: ``torch.tensor(tokens)``).
TRACE_SLACK = 1.10


class Attention(nn.Module):
    """One module whose peak is inside it: the (b, h, n, n) scores and their softmax."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        return x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class GeluMLP(nn.Module):
    """A 4x GELU intermediate, freed before the module returns."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class AttnStack(nn.Module):
    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(nn.Sequential(Attention(d), GeluMLP(d)) for _ in range(depth))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class LoopedDecoder(nn.Module):
    """Runs its decoder blocks once per frame (as the Wan VAE does), caching a tensor on itself."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.decoder = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(4))

    def decode(self, z):
        frames = []
        for f in range(z.shape[1]):
            h = z[:, f]
            for b in self.decoder:
                h = b(h)
            frames.append(h)
        self.last = frames[-1]  # a side effect the dry run must not leave behind
        return torch.stack(frames, 1)


class SelfMovingStack(AttnStack):
    """Moves a submodule to the input's device inside its forward, as HunyuanVideo 1.5 does with
    ``self.cond_type_embedding.to(txt.device)``: a no-op where the weights already are."""

    def __init__(self, d: int = 32) -> None:
        super().__init__(d)
        self.cond = nn.Embedding(3, d)

    def forward(self, x):
        self.cond.to(x.device)
        h = self.embed(x) + self.cond(torch.zeros_like(x[..., 0], dtype=torch.long))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


CASES = {
    "transformer": lambda: (seeded(TransformerStack(d=64, depth=4)), None, (torch.randint(0, 50, (8, 64), generator=_g()),)),
    "attention": lambda: (seeded(AttnStack()), None, (torch.randn(4, 48, 8, generator=_g()),)),
    "flux": lambda: (seeded(FluxLike()), None, (torch.randn(2, 64, 16, generator=_g()), torch.rand(2, generator=_g()))),
    "unet": lambda: (seeded(UNetLike()), None, (torch.randn(2, 4, 16, 16, generator=_g()), torch.rand(2, generator=_g()))),
    "tied": lambda: (seeded(TiedStack()), None, (torch.randint(0, 50, (2, 12), generator=_g()),)),
    "buffers": lambda: (seeded(BufferedStack()), None, (torch.randn(6, 8, generator=_g()),)),
    "fp8": lambda: (seeded(MixedDtypeStack()), None, (torch.randn(4, 32, generator=_g()),)),
    "moves_itself": lambda: (seeded(SelfMovingStack()), None, (torch.randn(4, 48, 8, generator=_g()),)),
    "looped": lambda: (seeded(LoopedDecoder()), "decode", (torch.randn(2, 3, 16, generator=_g()),)),
}


def _case(name):
    model, method, args = CASES[name]()
    return model, (getattr(model, method) if method else model), args


def _measured(model, fn, args):
    eng = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    with torch.no_grad():
        eng.run(fn, *args)
    return eng, eng.measurements[eng.last_signature]


@pytest.mark.parametrize("name", list(CASES))
def test_traced_figures_bound_the_measured_ones_unit_by_unit(name):
    model, fn, args = _case(name)
    eng, meas = _measured(model, fn, args)
    snap = snapshot(model)
    with torch.no_grad():
        tr = trace_units(model, eng.unitset.units, fn, args)
    assert tr.source == TRACED, tr.reason
    assert list(tr.measurements) == list(meas), "units entered in the same order"
    for n, m in meas.items():
        t = tr.measurements[n]
        assert t.calls == m.calls and t.modules == m.modules, n
        assert m.entry_bytes <= t.entry_bytes <= m.entry_bytes * TRACE_SLACK, (n, t, m)
        assert m.peak_bytes <= t.peak_bytes <= m.peak_bytes * TRACE_SLACK, (n, t, m)
    assert tr.peak_bytes == max(m.peak_bytes for m in tr.measurements.values())
    assert_unchanged(model, snap)


class ReenteredStack(nn.Module):
    """Enters its blocks again after others ran (0, 1, 0, 2, 1, 3, 2), each time with more live
    bytes (every output is kept), so a unit's calls and its largest entry are what the recorder
    must keep."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        outs = [x]
        for i in (0, 1, 0, 2, 1, 3, 2):
            outs.append(self.blocks[i](outs[-1]))
        return torch.stack(outs).sum(0)


@pytest.mark.parametrize("name", ["reentered", "looped"])
def test_the_dry_run_and_the_measuring_forward_record_the_same_figures(name):
    """One recorder of a unit's entry serves both: on CPU, where the dry run counts what the
    meter counts, a model that enters its units again gives the same figures either way."""
    if name == "reentered":
        model = seeded(ReenteredStack())
        fn, args = model, (torch.randn(4, 16, generator=_g()),)
    else:
        model, fn, args = _case(name)
    eng, meas = _measured(model, fn, args)
    with torch.no_grad():
        tr = trace_units(model, eng.unitset.units, fn, args)
    assert tr.source == TRACED, tr.reason
    assert any(m.calls > 1 for m in meas.values()), "the scenario needs units entered again"
    figures = lambda ms: {n: (m.entry_bytes, m.peak_bytes, m.calls, m.modules) for n, m in ms.items()}  # noqa: E731
    assert list(tr.measurements) == list(meas) and figures(tr.measurements) == figures(meas)


def test_a_peak_inside_one_module_is_seen():
    """The attention's scores and the GELU's intermediate live and die inside one module call:
    a check at module boundaries would miss them; the traced peak holds them."""
    model, fn, args = _case("attention")
    eng = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    with torch.no_grad():
        tr = trace_units(model, eng.unitset.units, fn, args)
    b, n, _ = args[0].shape
    scores = b * 4 * n * n * 4  # (b, heads, n, n) float32
    m = tr.measurements["blocks.0"]
    assert m.activation_bytes >= 2 * scores, "scores and their softmax are live together"


def test_a_looped_unit_is_counted_once_per_pass_and_its_side_effects_are_undone():
    model, fn, args = _case("looped")
    eng = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    with torch.no_grad():
        tr = trace_units(model, eng.unitset.units, fn, args)
    assert tr.source == TRACED
    assert all(tr.measurements[f"decoder.{i}"].calls == 3 for i in range(4))
    assert not hasattr(model, "last"), "an attribute set by the fake forward is removed"


def test_a_forward_that_moves_a_module_where_it_is_traces_and_leaves_no_trace():
    model, fn, args = _case("moves_itself")
    eng = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    snap = snapshot(model)
    with torch.inference_mode():  # as ComfyUI samples (the conversion fails on fakes there)
        tr = trace_units(model, eng.unitset.units, fn, args)
    assert tr.source == TRACED, tr.reason
    assert_unchanged(model, snap)
    assert not any("_apply" in vars(m) for m in model.modules()), "the in-place conversion is removed"
    model.cond.to(torch.float64)  # and the model converts as usual after the dry run
    assert model.cond.weight.dtype == torch.float64


def test_the_model_is_unchanged_when_the_forward_raises():
    model = seeded(ExplodingStack(at=2))
    model.armed = True
    snap = snapshot(model)
    hooks = nn.modules.module._global_forward_pre_hooks.copy(), nn.modules.module._global_forward_hooks.copy()
    eng = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    with torch.no_grad():
        tr = trace_units(model, eng.unitset.units, model, (torch.randint(0, 50, (2, 12), generator=_g()),))
    assert tr.source == MEASURED and tr.measurements is None and "Boom" in tr.reason
    assert_unchanged(model, snap)
    assert not any(m._forward_pre_hooks for m in model.modules()), "no unit hook left behind"
    assert (nn.modules.module._global_forward_pre_hooks, nn.modules.module._global_forward_hooks) == hooks
    assert not any(type(t).__name__ == "FakeTensor" for m in model.modules() for t in vars(m).values())


# ------------------------------------------------------------------------------------------------
# through the engine


@pytest.fixture
def forwards(monkeypatch):
    calls = []
    orig = SegmentedExecutor.forward

    def counted(self, *a, **k):
        calls.append(self.device_bytes)
        return orig(self, *a, **k)

    monkeypatch.setattr(SegmentedExecutor, "forward", counted)
    return calls


@pytest.mark.parametrize("name", ["transformer", "attention", "unet", "looped"])
def test_a_budget_too_small_is_refused_before_any_forward_with_the_exact_smallest_budget(name, forwards):
    model, fn, args = _case(name)
    with torch.no_grad():
        ref = fn(*args)
    snap = snapshot(model)
    eng = Engine(model, EngineConfig(budget_bytes=1024, device="cpu"))
    t0 = time.process_time()
    with pytest.raises(BudgetError) as e, torch.no_grad():
        eng.run(fn, *args)
    took = time.process_time() - t0
    assert not forwards and eng.executor.device_bytes == 0, "refused before anything was copied"
    assert took < 1.0, f"refusal took {took:.2f}s of CPU"
    err = e.value
    assert err.exact and "the smallest max_vram_gb that works for this shape is" in str(err)
    assert "at least" not in str(err)
    need = err.min_budget_bytes
    assert_unchanged(model, snap)
    with torch.no_grad():
        at = Engine(model, EngineConfig(budget_bytes=need, device="cpu"))
        assert torch.equal(at.run(fn, *args), ref), "the number works, with the unpatched output"
        assert at.last_plan.source == TRACED and at.last_stats.peak_device_bytes <= need
        with pytest.raises(BudgetError):
            Engine(model, EngineConfig(budget_bytes=need - 1, device="cpu")).run(fn, *args)
    assert_unchanged(model, snap)


def test_the_traced_plan_is_cached_per_signature_and_reported(monkeypatch):
    from vramcut_core import engine as engine_mod

    traced = []
    orig = engine_mod.trace_units
    monkeypatch.setattr(engine_mod, "trace_units", lambda *a, **k: traced.append(1) or orig(*a, **k))
    model, fn, args = _case("transformer")
    eng = Engine(model, EngineConfig(budget_bytes=1 << 30, device="cpu"))
    with torch.no_grad():
        for _ in range(3):
            eng.run(fn, *args)
        eng.run(fn, torch.randint(0, 50, (2, 9), generator=_g()))
    assert len(traced) == 2, "one dry run per input signature"
    d = eng.describe()
    assert d["source"] == "traced" and d["plan"]["source"] == "traced" and d["trace_reason"] is None
    assert "activations traced" in d["text"]


def test_a_forward_that_cannot_be_traced_is_measured_and_its_number_says_at_least(caplog):
    """A weight subclass whose type the forward checks has no fake form that passes the check: the
    first forward measures, the log and the plan say so, a refusal gives a lower bound."""
    model = seeded(QuantStack())
    x = torch.randn(4, 16, generator=_g())
    with torch.no_grad():
        ref = model(x)
        with caplog.at_level(logging.WARNING, logger="vramcut"):
            eng = Engine(model, EngineConfig(budget_bytes=1 << 30, device="cpu"))
            assert torch.equal(eng.run(model, x), ref)
        assert any("dry run could not run" in r.getMessage() for r in caplog.records)
        d = eng.describe()
        assert d["source"] == "measured" and "AssertionError" in d["trace_reason"]
        assert "the dry run could not run" in d["text"]
        small = Engine(model, EngineConfig(budget_bytes=8192, device="cpu"))
        with pytest.raises(BudgetError) as e:
            small.run(model, torch.randn(512, 16, generator=_g()))
    msg = str(e.value)
    assert not e.value.exact and "at least" in msg and "smallest" not in msg, msg


@pytest.mark.parametrize("name", ["attention", "unet", "looped"])
def test_a_preview_is_the_plan_the_first_forward_runs_and_copies_nothing(name, forwards, monkeypatch):
    from vramcut_core import engine as engine_mod
    from vramcut_core import signature

    model, fn, args = _case(name)
    with torch.no_grad():
        ref = fn(*args)
    snap = snapshot(model)
    need = Engine(model, EngineConfig(budget_bytes=1024, device="cpu"))
    with pytest.raises(BudgetError) as e, torch.no_grad():
        need.preview_as(signature(args, {}), fn, *args)
    assert not need.shapes.failures() and len(need.traces) == 1, "the profile stays, the verdict does not"
    budget = e.value.min_budget_bytes + 1
    eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu"))
    with torch.no_grad():
        plan = eng.preview_as(signature(args, {}), fn, *args)
    assert plan.source == TRACED and not forwards and eng.executor.device_bytes == 0
    assert eng.executor.peak_weight_bytes == 0 and eng.stats.forwards == 0 and not eng.shapes.plans()
    assert_unchanged(model, snap)
    traced = []
    orig = engine_mod.trace_units
    monkeypatch.setattr(engine_mod, "trace_units", lambda *a, **k: traced.append(1) or orig(*a, **k))
    ran = []
    orig_forward = SegmentedExecutor.forward
    monkeypatch.setattr(SegmentedExecutor, "forward",
                        lambda self, p, *a, **k: ran.append(p) or orig_forward(self, p, *a, **k))
    with torch.no_grad():
        assert torch.equal(eng.run(fn, *args), ref)
    assert not traced, "the first forward used the previewed profile"
    assert ran[0] == plan, "the first forward ran the previewed plan"
    assert_unchanged(model, snap)


def test_a_preview_that_cannot_trace_says_why_and_leaves_nothing():
    from vramcut_core import TraceUnavailable, signature

    model = seeded(QuantStack())
    x = torch.randn(4, 16, generator=_g())
    eng = Engine(model, EngineConfig(budget_bytes=1 << 30, device="cpu"))
    with pytest.raises(TraceUnavailable, match="AssertionError"), torch.no_grad():
        eng.preview_as(signature((x,), {}), model, x)
    assert not eng.traces and not eng.shapes.plans() and not eng.shapes.failures()


# ------------------------------------------------------------------------------------------------
# the minimum budget (pure)


def _random_units(rng):
    n = rng.randint(1, 9)
    return [PlanUnit(f"u{i}", rng.randint(1, 5000), rng.randint(0, 8000), 0,
                     keep_resident=rng.random() < 0.1, entered=rng.random() > 0.1, calls=rng.choice([1, 1, 1, 3]))
            for i in range(n)]


@pytest.mark.parametrize("options", [PlanOptions(), PlanOptions(prefetch=False), PlanOptions(residency=False)])
def test_min_budget_is_the_smallest_budget_that_plans(options):
    rng = random.Random(0)
    for _ in range(150):
        units = _random_units(rng)
        need = min_budget(units, options)
        assert need is not None
        make_plan(units, need, options)
        with pytest.raises(BudgetError) as e:
            make_plan(units, need - 1, options)
        assert e.value.min_budget_bytes == need and e.value.exact
        # feasibility is monotone (a sweep above the minimum always plans)
        for b in range(need, need + 20000, 997):
            make_plan(units, b, options)


def test_min_budget_with_the_finer_cut():
    parts = {"big": [PlanUnit("big.a", 300, 50, 0), PlanUnit("big.b", 300, 50, 0)]}
    units = [PlanUnit("big", 600, 50, 0), PlanUnit("small", 100, 20, 0)]
    split = lambda n: parts.get(n)  # noqa: E731
    need = min_budget(units, PlanOptions(), split)
    assert make_plan(units, need, PlanOptions(), split).split == ("big",)
    with pytest.raises(BudgetError):
        make_plan(units, need - 1, PlanOptions(), split)
    assert need < 600 + 50, "cut finer, the smallest budget is below the whole unit's"


def test_gib_text_rounds_up_at_the_widget_precision():
    rng = random.Random(1)
    for n in [1, 1023, 1 << 20, (1 << 30) - 1, 1 << 30, 3 * (1 << 30) + 7] + [rng.randint(1, 1 << 36) for _ in range(500)]:
        text = gib_text(n)
        assert len(text.split(".")[1]) == 3
        assert gib_to_bytes(text) >= n, (n, text)
        if float(text) > 0.001:
            assert gib_to_bytes(f"{float(text) - 0.001:.3f}") < n, (n, text)


class GrowingBlock(GeluMLP):
    """Allocates a large scratch tensor once ``grow`` is set (a host that changes behaviour)."""

    grow = False

    def forward(self, x):
        if self.grow:
            scratch = torch.ones(64, 1024)  # 256 KiB live while the block runs
            return super().forward(x) + (scratch[0, 0] - 1)  # + 0.0: the output is unchanged
        return super().forward(x)


def test_a_steady_forward_above_the_budget_replans_once(caplog):
    model = seeded(nn.Sequential(*[GrowingBlock(32) for _ in range(4)]))
    x = torch.randn(8, 32, generator=_g())
    with torch.no_grad():
        ref = model(x)
        GrowingBlock.grow = True  # the smallest budget for the grown forward
        try:
            with pytest.raises(BudgetError) as e:
                Engine(model, EngineConfig(budget_bytes=1024, device="cpu")).run(model, x)
        finally:
            GrowingBlock.grow = False
        budget = e.value.min_budget_bytes
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", track_cpu_memory=True))
        with eng.session(), caplog.at_level(logging.WARNING, logger="vramcut"):
            assert torch.equal(eng.run(model, x), ref)
            first = eng.last_plan
            GrowingBlock.grow = True
            try:
                for _ in range(3):
                    assert torch.equal(eng.run(model, x), ref)
            finally:
                GrowingBlock.grow = False
    warned = [r.getMessage() for r in caplog.records if "above the budget" in r.getMessage()]
    assert len(warned) == 1, warned
    assert eng.last_plan is not first and first.resident_bytes > eng.last_plan.resident_bytes
    assert eng.last_plan.activation_reserve_bytes >= first.activation_reserve_bytes + (256 << 10)


def test_a_call_that_reaches_the_engine_from_inside_its_dry_run_runs_plainly():
    """A host entry point that calls back into the engine (a VAE that tiles itself calls its own
    patched decode per tile): inside the dry run the inner call runs on the fakes, plans nothing,
    and the model keeps its own weights."""
    model, fn, args = _case("transformer")
    with torch.no_grad():
        ref = fn(*args)
    snap = snapshot(model)
    eng = Engine(model, EngineConfig(budget_bytes=1 << 30, device="cpu"))

    def tiles(x):  # two "tiles", each through the engine unless a forward of it is running
        run = (lambda t: model(t)) if eng.executor.running else (lambda t: eng.run(model, t))
        return torch.cat([run(x[:4]), run(x[4:])])

    with torch.no_grad():
        out = eng.run(tiles, *args)
    assert torch.equal(out, ref)
    assert len(eng.traces) == 1 and next(iter(eng.traces.values())).source == TRACED
    assert_unchanged(model, snap)
