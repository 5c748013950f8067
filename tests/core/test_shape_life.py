"""A shape's life (``vramcut_core.shape``), walked through every state and transition on one and
on two simulated GPUs: the same lifecycle for one device and several.

NEW -> TRACED (a preview) -> MEASURING, aborted by an interrupt -> TRACED -> MEASURING -> PLANNED
-> STEADY -> AGAIN (a temporary grew past the budget) -> PLANNED again (measured once more, the
plan says why) -> STEADY, and no second measure-again however often it passes again -> TO_PLACE
(the budget fell: re-fit) -> PLANNED again without measuring -> STEADY -> TO_PLACE -> REFUSED
(budgets too small; the same error again, nothing runs) -> reopened by new budgets -> measured
again -> STEADY. Every output bit-equal to the unpatched model's; every transition asked of a
state it does not start from is refused with an error naming both.
"""
from __future__ import annotations

import gc

import pytest
import torch

from sim_cuda import simulated_cuda
from test_sim_multi_gpu import budgets
from test_sim_replan import GrowingBlock, GrowingStack
from toys import seeded
from vramcut_core import BudgetError, Engine, EngineConfig, signature
from vramcut_core.figures.trace import tracing
from vramcut_core.shape import (AGAIN, NEW, PLANNED, REFUSED, STEADY, TO_PLACE, TRACED, InvalidTransition,
                                Shape)


@pytest.fixture(params=[1, 2], ids=["1gpu", "2gpu"])
def simn(request, monkeypatch):
    monkeypatch.setattr(GrowingBlock, "extra", 0)
    with simulated_cuda(monkeypatch, devices=request.param) as s:
        yield s
        gc.collect()
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


def _engine(model, devs):
    if len(devs) == 1:
        return Engine(model, EngineConfig(budget_bytes=devs[0][1], device="cuda:0"))
    return Engine(model, EngineConfig(budget_bytes=sum(b for _, b in devs), device="cuda:0", devices=tuple(devs)))


def _set(eng, devs):
    if eng.group is None:
        eng.set_budget(devs[0][1])
    else:
        eng.set_devices(devs)


def _peaks(eng):
    """Each device's measured peak in the last forward, and its plan's."""
    if eng.group is None:
        return {"cuda:0": (eng.last_stats.peak_device_bytes, eng.last_plan.peak_bytes, eng.config.budget_bytes)}
    return {d.device: (eng.last_device_stats[d.device].peak_device_bytes, d.plan.peak_bytes, d.budget_bytes)
            for d in eng.placement.used}


def test_a_shape_walks_every_state_on_one_and_two_devices(simn):
    sim = simn
    n = sim.n_devices
    with sim.host_memory():
        model = seeded(GrowingStack())
        x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x)
    x = x.clone()   # made outside host memory: the home device's
    sig = signature((x,), {})
    seen: list[str] = []
    with torch.no_grad():
        devs = budgets(model, (x,), n)
        eng = _engine(model, devs)
        assert eng.shapes.get(sig) is None
        eng.preview_as(sig, model, x)
        s = eng.shapes[sig]
        seen.append(s.state)                                   # TRACED: the dry run only
        assert s.trace is not None and s.plan is None and eng.stats.forwards == 0

        def boom(*_a):
            if not tracing():   # the real forward, not a dry run on fakes
                raise KeyError("interrupted")

        h = model.blocks[5].register_forward_pre_hook(boom)
        with pytest.raises(KeyError):
            eng.run(model, x)
        h.remove()
        seen.append(s.state)                                   # aborted: back to TRACED
        with eng.session():
            outs = [eng.run(model, x)]
            seen.append(s.state)                               # PLANNED from the measuring forward
            first = s.plan
            outs.append(eng.run(model, x))
            seen.append(s.state)                               # STEADY

            # a temporary grows past what the plan left free on every device: measure again, once
            room = max(b - plan_peak for _, plan_peak, b in _peaks(eng).values())
            GrowingBlock.extra = (room + 16 * 1024) // 4
            outs.append(eng.run(model, x))
            seen.append(s.state)                               # AGAIN
            assert s.plan is None and "above" in s.again
            outs.append(eng.run(model, x))
            seen.append(s.state)                               # PLANNED again, from the larger figures
            assert s.plan is not first and any(w.startswith("planned again") for w in s.plan.warnings)
            for _ in range(2):
                outs.append(eng.run(model, x))
                seen.append(s.state)                           # STEADY: never measured again
            for d, (peak, _, b) in _peaks(eng).items():
                assert peak <= b, f"{d}: {peak} B over its budget {b} B after planning again"
            GrowingBlock.extra = 0
            measured = eng.stats.forwards - eng.steady_stats.forwards

            # the budget falls below the plan's peak on the last device: re-fit, placed again
            used = _peaks(eng)
            last_dev = list(used)[-1]
            fell = [(d, b if d != last_dev else used[d][1] - used[d][1] // 5) for d, b in devs]
            _set(eng, fell)
            seen.append(s.state)                               # TO_PLACE
            outs.append(eng.run(model, x))
            seen.append(s.state)                               # STEADY (placed again and run)
            assert eng.stats.forwards - eng.steady_stats.forwards == measured, "placed again without measuring"
            assert s.plan.refit is not None and "the budget fell" in s.plan.refit.reason

            # budgets too small for the measured shape: refused, the same error every time
            tiny = [(d, 4096) for d, _ in devs]
            _set(eng, tiny)
            seen.append(s.state)                               # TO_PLACE
            with pytest.raises(BudgetError) as e1:
                eng.run(model, x)
            seen.append(s.state)                               # REFUSED
            forwards = eng.stats.forwards
            with pytest.raises(BudgetError) as e2:
                eng.run(model, x)
            assert e2.value is e1.value and eng.stats.forwards == forwards, "refused again, nothing ran"

            # budgets back: reopened, measured again, steady
            _set(eng, devs)
            seen.append(s.state)                               # TRACED (reopened)
            outs.append(eng.run(model, x))
            seen.append(s.state)                               # PLANNED
            outs.append(eng.run(model, x))
            seen.append(s.state)                               # STEADY
    assert seen == [TRACED, TRACED, PLANNED, STEADY, AGAIN, PLANNED, STEADY, STEADY, TO_PLACE, STEADY,
                    TO_PLACE, REFUSED, TRACED, PLANNED, STEADY], seen
    for i, o in enumerate(outs):
        assert torch.equal(o, ref), f"forward {i + 1} differs from the unpatched model"
    assert (eng.placement is not None) == (n > 1)


@pytest.mark.parametrize("state,transition,args", [
    (NEW, "ran", ()), (NEW, "planned_as", (None,)), (NEW, "measure_again", ("why",)), (NEW, "to_place", ()),
    (NEW, "refuse", (None,)), (NEW, "reopen", ()), (NEW, "abort", ()), (NEW, "measured", ({},)),
    (TRACED, "replanned", (None,)), (PLANNED, "measuring", ()), (STEADY, "refuse", (None,)),
    (AGAIN, "ran", ()), (TO_PLACE, "measuring", ()), (REFUSED, "ran", ()),
])
def test_a_transition_from_the_wrong_state_names_both(state, transition, args):
    s = Shape(("x",), lambda n: n)
    s.state = state
    with pytest.raises(InvalidTransition, match=f"it is {state!r}, not "):
        getattr(s, transition)(*args)
    assert s.state == state


def test_a_shape_is_measured_again_once_in_its_life():
    s = Shape(("x",), lambda n: n)
    s.state = STEADY
    assert s.measure_again("forward 4 peaked") and s.state == AGAIN
    s.state = STEADY
    assert not s.measure_again("forward 9 peaked") and s.state == STEADY and s.again == "forward 4 peaked"
