import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramcut_core import BudgetError, PlanOptions, PlanUnit, build_plan, make_plan, plan_to_json, plan_to_text
from vramcut_core.planning.budget import gib_to_bytes
from vramcut_core.planning.plan import _Infeasible

MB = 1 << 20


def uniform(n=10, w=100 * MB, act=20 * MB, prelude=10 * MB):
    units = [PlanUnit("prelude", prelude, act, act // 2)]
    units += [PlanUnit(f"blocks.{i}", w, act, act // 2) for i in range(n)]
    units.append(PlanUnit("final", prelude, act, act // 2))
    return units


def assert_well_formed(plan, units):
    got = [i for s in plan.segments for i in s.units]
    assert got == list(range(len(units))), "segments must cover every unit once, in order"
    for s in plan.segments:
        assert list(s.units) == list(range(s.units[0], s.units[-1] + 1)), "segments are contiguous"
        assert s.peak_bytes <= plan.budget_bytes
        if not s.resident:
            members = [units[i] for i in s.units]
            if len(members) > 1:  # merged: every unit entered once, the segment fits one slot
                assert all(u.entered and u.calls == 1 for u in members)
                assert s.weight_bytes <= plan.slot_bytes
            elif members[0].entered:
                assert s.weight_bytes <= plan.slot_bytes
    assert plan.peak_bytes <= plan.budget_bytes
    assert plan.peak_bytes == plan.resident_bytes + plan.window_bytes + (plan.activation_reserve_bytes or 0)


def test_everything_resident_when_it_fits():
    units = uniform()
    total = sum(u.weight_bytes for u in units)
    plan = build_plan(units, total + 20 * MB)
    assert len(plan.segments) == 1 and plan.segments[0].resident
    assert plan.streamed_bytes_per_forward == 0 and plan.slots == 0
    assert_well_formed(plan, units)


def test_residency_keeps_as_much_as_fits_after_the_window():
    units = uniform()
    budget = 600 * MB
    plan = build_plan(units, budget)
    assert plan.slots == 2 and plan.slot_bytes == 100 * MB
    # 600 - 2*100 (window) - 20 (activations) leaves 380 MiB: three blocks (largest first)
    assert plan.resident_units == ("blocks.0", "blocks.1", "blocks.2")
    assert plan.streamed_bytes_per_forward == 7 * 100 * MB + 2 * 10 * MB
    assert_well_formed(plan, units)


def test_no_residency_and_no_prefetch_switches():
    units = uniform()
    p = build_plan(units, 600 * MB, PlanOptions(residency=False))
    assert p.resident_bytes == 0 and p.slots == 2
    q = build_plan(units, 600 * MB, PlanOptions(prefetch=False))
    assert q.slots == 1 and q.resident_bytes == 4 * 100 * MB


def test_tight_budget_drops_prefetch_with_a_warning():
    units = uniform()
    plan = build_plan(units, 150 * MB)
    assert plan.slots == 1 and plan.resident_bytes == 0
    assert any("no room for prefetch" in w for w in plan.warnings)
    assert_well_formed(plan, units)


def test_units_that_must_stay_resident_always_are():
    units = uniform()
    units[1] = PlanUnit("blocks.0", 100 * MB, 20 * MB, 10 * MB, keep_resident=True)
    plan = build_plan(units, 350 * MB, PlanOptions(residency=False))
    assert plan.resident_units == ("blocks.0",)


def test_units_never_entered_are_not_counted_as_streamed_or_made_resident_first():
    units = uniform(n=4)
    units[2] = PlanUnit("blocks.1", 100 * MB, None, None, entered=False)
    units = [PlanUnit(u.name, u.weight_bytes, u.peak_bytes or 0, u.entry_bytes or 0, entered=u.entered)
             for u in units]
    plan = build_plan(units, 340 * MB)
    assert "blocks.1" not in plan.resident_units
    assert "blocks.1" not in plan.streamed_order
    assert plan.streamed_bytes_per_forward == sum(
        u.weight_bytes for u in units if u.entered and u.name not in plan.resident_units)


def test_infeasible_raises_clear_error_naming_unit_bytes_and_budget():
    units = uniform()
    with pytest.raises(BudgetError) as e:
        make_plan(units, 110 * MB)
    msg = str(e.value)
    # the budget and the need at the widget's three decimals (110 MiB = 0.107 GiB; 120 MiB rounds up)
    assert "blocks.0" in msg and "0.107 GiB" in msg and "0.118 GiB" in msg and "cannot be cut finer" in msg
    assert e.value.unit == "blocks.0" and e.value.need_bytes == 120 * MB


def test_finer_cut_splits_the_unit_that_does_not_fit():
    units = uniform(n=3)
    calls = []

    def split(name):
        calls.append(name)
        if name.count(".") > 1:
            return None
        return [PlanUnit(f"{name}.{k}", 25 * MB, 20 * MB, 10 * MB) for k in range(4)]

    plan = make_plan(units, 100 * MB, split_unit=split)
    assert set(plan.split) == {"blocks.0", "blocks.1", "blocks.2"}
    assert plan.slot_bytes == 25 * MB
    assert [u.name for u in plan.units][1:5] == [f"blocks.0.{k}" for k in range(4)]
    assert plan.peak_bytes <= 100 * MB
    assert_well_formed(plan, list(plan.units))


def test_a_must_stay_resident_set_over_budget_says_so():
    units = [PlanUnit("shared", 200 * MB, 0, 0, keep_resident=True), PlanUnit("b", 10 * MB, 0, 0)]
    with pytest.raises(BudgetError, match="must stay resident"):
        make_plan(units, 100 * MB)


@pytest.mark.parametrize("bad", [0, -1, "x", float("nan"), None, float("inf")])
def test_gib_to_bytes_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        gib_to_bytes(bad)


def test_make_plan_rejects_non_positive_budget():
    with pytest.raises(ValueError):
        make_plan(uniform(), 0)


unit_lists = st.lists(
    st.tuples(st.integers(1, 400), st.integers(0, 60), st.booleans()), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(unit_lists, st.booleans(), st.booleans())
def test_larger_budget_never_streams_more_bytes_nor_more_transfers_at_equal_bytes(rows, prefetch, residency):
    """Streamed bytes per forward never grow with the budget, and where they stay equal the
    transfers never grow either. A larger budget *can* need more transfers when it streams fewer
    bytes (bytes come first): a 100 MiB unit and four 10 MiB units stream 140 MiB in 2 transfers
    at 119 MiB (one slot, the four small units merged), 40 MiB in 4 transfers at 125 MiB (the large
    unit resident, slots of 10 MiB); see test_more_budget_can_mean_more_transfers_for_fewer_bytes."""
    units = [PlanUnit(f"u{i}", w * MB, a * MB, a * MB // 2, keep_resident=(p and i == 0)) for i, (w, a, p) in enumerate(rows)]
    opts = PlanOptions(prefetch=prefetch, residency=residency)
    prev = None
    for budget in range(10 * MB, sum(u.weight_bytes for u in units) + 200 * MB, 23 * MB):
        try:
            plan = build_plan(units, budget, opts)
        except _Infeasible:
            assert prev is None, "a budget that fitted must keep fitting when it grows"
            continue
        assert_well_formed(plan, units)
        if prev is not None:
            assert plan.streamed_bytes_per_forward <= prev.streamed_bytes_per_forward
            if plan.streamed_bytes_per_forward == prev.streamed_bytes_per_forward:
                assert plan.transfers_per_forward <= prev.transfers_per_forward
        prev = plan


looped_rows = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 40), st.integers(0, 2)), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(looped_rows, st.integers(1, 37))
def test_monotone_with_looped_and_unentered_units(rows, step):
    """The same orderings with units a forward never enters (0) and looped units (2 calls)."""
    units = [PlanUnit(f"u{i}", w * MB, a * MB, a * MB // 2, entered=c > 0, calls=max(c, 1))
             for i, (w, a, c) in enumerate(rows)]
    prev = None
    for budget in range(5 * MB, sum(u.weight_bytes for u in units) + 100 * MB, step * MB):
        try:
            plan = build_plan(units, budget)
        except _Infeasible:
            assert prev is None
            continue
        assert_well_formed(plan, units)
        for s in plan.segments:
            if len(s.units) > 1 and not s.resident:
                assert all(units[i].entered and units[i].calls == 1 for i in s.units)
        if prev is not None:
            assert plan.streamed_bytes_per_forward <= prev.streamed_bytes_per_forward
            if plan.streamed_bytes_per_forward == prev.streamed_bytes_per_forward:
                assert plan.transfers_per_forward <= prev.transfers_per_forward
        prev = plan


def test_more_budget_can_mean_more_transfers_for_fewer_bytes():
    """Why the monotone claim on transfers only holds at equal streamed bytes."""
    units = [PlanUnit("big", 100 * MB, 0, 0)] + [PlanUnit(f"s{i}", 10 * MB, 0, 0) for i in range(4)]
    a, b = build_plan(units, 119 * MB), build_plan(units, 125 * MB)
    assert (a.streamed_bytes_per_forward, a.transfers_per_forward) == (140 * MB, 2)
    assert (b.streamed_bytes_per_forward, b.transfers_per_forward) == (40 * MB, 4)


def test_adjacent_streamed_units_share_one_transfer():
    units = uniform(n=20, w=10 * MB, act=0, prelude=1 * MB)
    plan = build_plan(units, 120 * MB, PlanOptions(residency=False))
    streamed = [s for s in plan.segments if not s.resident]
    assert plan.transfers_per_forward == len(streamed) < sum(len(s.units) for s in streamed)
    assert max(s.weight_bytes for s in streamed) <= plan.slot_bytes
    # the slot grows to a share of the spare room, and no further than the room allows
    spare = plan.budget_bytes - plan.resident_bytes - (plan.activation_reserve_bytes or 0)
    assert 10 * MB <= plan.slot_bytes <= max(10 * MB, spare // 4) and plan.peak_bytes <= plan.budget_bytes
    assert plan.streamed_groups == tuple(tuple(plan.units[i].name for i in s.units) for s in streamed)


def test_looped_and_unentered_units_are_segments_of_their_own():
    units = [PlanUnit(f"b{i}", 10 * MB, 0, 0) for i in range(6)]
    units[2] = PlanUnit("b2", 10 * MB, 0, 0, calls=3)
    units[5] = PlanUnit("b5", 10 * MB, 0, 0, entered=False)
    plan = build_plan(units, 70 * MB, PlanOptions(residency=False))
    segs = [tuple(plan.units[i].name for i in s.units) for s in plan.segments]
    assert ("b2",) in segs and ("b5",) in segs
    assert plan.transfers_per_forward == len(plan.streamed_groups) - 1 + 3
    assert "b5" not in [n for g in plan.streamed_groups for n in g]


def test_a_small_lone_unit_is_kept_resident_when_that_removes_a_transfer():
    # largest first keeps a and c; the window for b, d, e leaves 10 MiB: the tiny unit between
    # two resident ones would be a transfer of its own, so it stays resident too
    units = [PlanUnit(n, w * MB, 0, 0) for n, w in
             [("b", 90), ("a", 100), ("tiny", 1), ("c", 100), ("d", 90), ("e", 90)]]
    plan = build_plan(units, 390 * MB)
    assert set(plan.resident_units) == {"a", "tiny", "c"}
    assert plan.transfers_per_forward == 3 and plan.streamed_bytes_per_forward == 270 * MB
    assert plan.peak_bytes <= plan.budget_bytes
    # not when it is no small share of the spare room
    big_tiny = [u if u.name != "tiny" else PlanUnit("tiny", 5 * MB, 0, 0) for u in units]
    assert "tiny" not in build_plan(big_tiny, 395 * MB).resident_units


def test_report_json_keys_and_text():
    units = uniform(n=4)
    plan = build_plan(units, 400 * MB)
    j = plan_to_json(plan)
    json.dumps(j)
    assert {"budget_bytes", "peak_bytes", "streamed_bytes_per_forward", "units", "segments"} <= set(j)
    assert set(j["units"][0]) >= {"name", "weight_bytes", "activation_bytes"}
    assert set(j["segments"][0]) >= {"name", "units", "weight_bytes", "activation_bytes", "peak_bytes", "resident"}
    assert j["peak_bytes"] <= j["budget_bytes"]
    unmeasured = build_plan([PlanUnit(u.name, u.weight_bytes) for u in units], 400 * MB)
    assert all(u["activation_bytes"] is None for u in plan_to_json(unmeasured)["units"])
    text = plan_to_text(plan)
    assert "resident" in text and "streamed" in text and "budget 0.391 GiB" in text


def test_report_text_counts_idle_segments_apart_from_streamed():
    """The text's footer counts as the node's chart does: a segment no forward ran is idle, not
    streamed (the encoder during a VAE decode)."""
    units = uniform(n=6)
    units += [PlanUnit(f"encoder.{i}", 100 * MB, 20 * MB, 10 * MB, entered=False) for i in range(3)]
    plan = build_plan(units, 400 * MB)
    segs = plan_to_json(plan)["segments"]
    counts = {w: sum(1 for s in segs if (s["resident"] and w == "resident") or (not s["resident"] and s["idle"] and w == "idle")
                     or (not s["resident"] and not s["idle"] and w == "streamed")) for w in ("resident", "streamed", "idle")}
    assert counts["idle"] >= 1 and counts["streamed"] >= 1, segs
    footer = next(line for line in plan_to_text(plan).splitlines() if line.startswith("streamed per call"))
    assert footer.endswith(f"{counts['resident']} resident · {counts['streamed']} streamed · {counts['idle']} idle segments"), footer
