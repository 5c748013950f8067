"""Time in the engine on CPU: ``EngineConfig.speed`` and the figures that time a plan.

On CPU the default ("auto") plans by count, exactly as before, with no compute times and no
prediction (a figure cached on the machine cannot change a plan). With ``speed="time"`` and the
two figures given, the traced plan carries the dry run's FLOP estimate, the first forward times
each unit (wall time, copies left out), the plan is made from those times with copies that do not
overlap, and the report shows the prediction, then the measured time per forward."""
from __future__ import annotations

import pytest
import torch

from toys import TransformerStack, seeded
from test_executor import ids
from vramcut_core import Engine, EngineConfig, plan_to_json, plan_to_text
from vramcut_core.planning.timeline import predict


def build():
    with torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        return model, x, model(x)


def half(model) -> int:
    """Room for half the weights beside the activations: some units stream."""
    probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    with torch.no_grad():
        probe.run(model, ids())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights // 2 + probe.last_plan.activation_reserve_bytes


def test_cpu_plans_by_count_by_default_with_no_times():
    model, x, ref = build()
    a = Engine(model, EngineConfig(budget_bytes=half(model), device="cpu", bandwidth_bytes_per_s=1e9,
                                   flops_per_s=1e9))
    b = Engine(model, EngineConfig(budget_bytes=half(model), device="cpu", speed="count"))
    with torch.no_grad():
        assert torch.equal(a.run(model, x), ref) and torch.equal(b.run(model, x), ref)
    assert a.last_plan == b.last_plan
    assert a.last_plan.time is None and all(u.compute_s is None for u in a.last_plan.units)
    assert "time" not in plan_to_json(a.last_plan) and "predicted" not in plan_to_text(a.last_plan)


def test_speed_time_on_cpu_plans_from_measured_unit_times_without_overlap():
    model, x, ref = build()
    bps = 2e8
    eng = Engine(model, EngineConfig(budget_bytes=half(model), device="cpu", speed="time",
                                     bandwidth_bytes_per_s=bps, flops_per_s=1e9))
    with torch.no_grad():
        traced = eng.preview_as(("x",), model, x)
        assert traced.time is not None and traced.time.source == "flops"
        with eng.session():
            outs = [eng.run(model, x) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    plan = eng.last_plan
    assert plan.time.source == "measured" and plan.streamed_order
    assert all(u.compute_s is not None and u.compute_s > 0 for u in plan.units if u.entered)
    # with the executor's own cost of a call, measured once (executor.call_seconds) and cached
    call_s = eng.planner.figures.call_s(eng.config)
    assert call_s > 0
    assert plan.time.predicted_s == pytest.approx(predict(plan, bps, overlap=False).step_s + call_s)
    assert plan.time.resident_s == pytest.approx(sum(u.compute_s for u in plan.units if u.entered))
    # the least step any residency can reach under the model, and the plan's gap to it
    assert plan.time.resident_s <= plan.time.bound_s <= plan.time.predicted_s * (1 + 1e-9)
    j = plan_to_json(plan, eng.stats, eng.steady_stats)["time"]
    assert j["source"] == "measured" and j["measured_s"] > 0 and j["error"] is not None
    assert j["bound_s"] == plan.time.bound_s and j["gap"] == pytest.approx(plan.time.gap)
    assert eng.steady_stats.timed == 2


@pytest.mark.parametrize("field, value", [("speed", "fast"), ("bandwidth_bytes_per_s", 0),
                                          ("flops_per_s", -1.0), ("bandwidth_bytes_per_s", True)])
def test_a_bad_speed_setting_is_a_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(budget_bytes=1 << 30, **{field: value})


def test_cpu_times_units_in_the_forward_after_the_measuring_one_resident_units_too():
    """The measuring forward's CPU meter runs Python at every operator: its wall times are not the
    units' times. The forward after it is timed instead, every unit hooked, with no meter."""
    model, x, ref = build()
    eng = Engine(model, EngineConfig(budget_bytes=half(model), device="cpu"))
    with torch.no_grad(), eng.session():
        assert torch.equal(eng.run(model, x), ref)
        sig = eng.last_signature
        assert eng.shapes[sig].times.seconds() is None
        assert torch.equal(eng.run(model, x), ref)
        secs = eng.shapes[sig].times.seconds()
        plan = eng.last_plan
        assert plan.resident_units and plan.streamed_order
        assert set(secs) == {u.name for u in plan.units if u.entered} and all(s > 0 for s in secs.values())
        assert torch.equal(eng.run(model, x), ref)
        assert eng.shapes[sig].times.seconds() == secs  # timed once, not on every forward
