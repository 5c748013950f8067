"""The timeline model (vramcut_core.planning.timeline): steady step times and stalls checked against
timelines worked out by hand (the arithmetic in each test's comments), and a plan's prediction
built from its segments."""
from __future__ import annotations

import pytest

import random

from vramcut_core import PlanUnit, build_plan
from vramcut_core.planning import walk
from vramcut_core.planning.plan import PlanOptions, plan_from_residency
from vramcut_core.planning.timeline import Step, plan_steps, predict, simulate

R = Step  # Step(compute) is resident; Step(compute, copy) is streamed


def test_all_resident_is_the_compute():
    t = simulate([R(2.0), R(3.0)])
    assert t.step_s == 5.0 and t.stalls == (0.0, 0.0) and t.copied == (False, False)


def test_synchronous_copies_add_up():
    # R1, A(compute 2, copy 3), B(compute 1, copy 4), C(compute 1, copy 2): nothing hides a copy
    # step = 1 + (3 + 2) + (4 + 1) + (2 + 1) = 14; stalls are the copies
    t = simulate([R(1), Step(2, 3), Step(1, 4), Step(1, 2)], overlap=False)
    assert t.step_s == 14 and t.stalls == (0, 3, 4, 2)


def test_one_slot_copies_behind_the_resident_units_before_a_group():
    # The same with one slot (depth 0): each copy waits for its slot (the group before it done),
    # not for the compute queued since. A's copy is issued when the call begins (C of the call
    # before is done at 0): [0,3] beside R [0,1]: A waits to 3 (stall 2) [3,5]; B's copy needs
    # A done: [5,9], B [9,10]; C's [10,12], C [12,13]. Step 13.
    t = simulate([R(1), Step(2, 3), Step(1, 4), Step(1, 2)], depth=0)
    assert t.step_s == 13 and t.stalls == (0, 2, 4, 2)
    # a resident unit between two groups hides the second one's copy: A [.., ..], R2 after it
    t = simulate([Step(1, 3), R(2), Step(1, 3)], depth=0)
    # A's copy [0,3] (B of the call before done at 0), A [3,4]; B's copy after A: [4,7] beside
    # R [4,6]; B waits to 7 [7,8]. Step 8.
    assert t.step_s == 8 and t.stalls == (3, 0, 1)


def test_prefetch_hides_copies_behind_compute():
    # R4, then A, B, C each compute 2, copy 1; two slots (depth 1). Steady step from 0:
    #   the previous step ran A [-6,-4], B [-4,-2], C [-2,0]; C's copy ended by -3.
    #   A's copy: after C's copy (-3) and once B (two streamed earlier) left its slot (-2): [-2,-1]
    #   R [0,4]; A [4,6], no stall; B's copy waits for C's slot (0): [0,1]; B [6,8]
    #   C's copy waits for A's slot (6): [6,7]; C [8,10]. Step 10 = compute alone.
    t = simulate([R(4), Step(2, 1), Step(2, 1), Step(2, 1)])
    assert t.step_s == 10 and t.stall_s == 0 and t.copied == (False, True, True, True)


def test_a_copy_bound_step_is_the_copy_stream():
    # R1, then A, B, C each compute 1, copy 3; two slots. The copy stream never rests:
    #   copies [-1,2] A, [2,5] B, [5,8] C (each after the one before; slots are free earlier:
    #   B's waits for C(prev) ending at 0, C's for A ending at 3, next A's for B ending at 6).
    #   R [0,1]; A waits to 2 (stall 1) [2,3]; B waits to 5 (stall 2) [5,6]; C to 8 (stall 2) [8,9].
    # Step 9 = 3 copies of 3; stalls 1 + 2 + 2 = 9 - 4 of compute.
    t = simulate([R(1), Step(1, 3), Step(1, 3), Step(1, 3)])
    assert t.step_s == 9 and t.stalls == (0, 1, 2, 2)
    assert t.step_s == t.compute_s + t.stall_s


def test_the_slot_not_the_stream_can_hold_a_copy_back():
    # A, B, C compute 1 copy 2, then R10: the copy stream is busy 6 s of a 14 s step, but C's
    # copy needs A's slot (two slots), free only when A ends. A's and B's copies ran during the
    # last step's R. A [0,1], B [1,2]; C's copy [1,3]; C waits to 3 (stall 1) [3,4]; R [4,14].
    t = simulate([Step(1, 2), Step(1, 2), Step(1, 2), R(10)])
    assert t.step_s == 14 and t.stalls == (0, 0, 1, 0)
    # with three slots (depth 2) C's copy runs beside A and B: nothing stalls
    assert simulate([Step(1, 2), Step(1, 2), Step(1, 2), R(10)], depth=2).step_s == 13


def test_copies_back_to_back_bound_the_step():
    # A, B, C compute 1 copy 2: 6 s of copies per step, 3 of compute. Steady, from 0: the last
    # step's copies ended at -5 (A), -3 (B), -1 (C), its computes at -4, -2, 0.
    # A's copy after C's (-1) and B's slot (-2): [-1,1], A [1,2] (stall 1); B's after A's copy (1)
    # and C's slot (0): [1,3], B [3,4] (stall 1); C's after B's (3) and A's slot (2): [3,5],
    # C [5,6] (stall 1). Step 6 = the copies.
    t = simulate([Step(1, 2), Step(1, 2), Step(1, 2)])
    assert t.step_s == 6 and t.stalls == (1, 1, 1)


def test_segments_that_fit_the_slots_stay_there_in_a_session():
    # Two streamed segments, two slots: after the first forward both stay in their slots.
    t = simulate([R(1), Step(1, 5), Step(1, 5)])
    assert t.step_s == 3 and t.copied == (False, False, False)
    # Without a session the slots are freed after each forward: both copies start at 0,
    # A's [0,5], B's [5,10]; R [0,1]; A waits to 5 (stall 4) [5,6]; B waits to 10 (stall 4).
    t = simulate([R(1), Step(1, 5), Step(1, 5)], session=False)
    assert t.step_s == 11 and t.stalls == (0, 4, 4) and t.copied == (False, True, True)


def test_each_device_has_its_own_copy_stream_and_a_hop_costs_its_time():
    # Device 0: A0 B0 C0, device 1: A1 B1 C1, each compute 1 copy 2; a hop of 0.5 between them.
    # On one copy stream that is 12 s of copies per step; on two, 6 each and they overlap the
    # other device's compute. Per device: A [0,1], B [1,2]; C's copy waits for A's slot (1) [1,3],
    # C [3,4] (stall 1). Hop to 4.5; the same on device 1: A1 [4.5,5.5], B1 [5.5,6.5], C1's copy
    # [5.5,7.5], C1 [7.5,8.5]. Step 8.5 = 6 compute + 0.5 hop + 2 stall.
    two = [Step(1, 2, 0), Step(1, 2, 0), Step(1, 2, 0), Step(1, 2, 1, hop_s=0.5), Step(1, 2, 1), Step(1, 2, 1)]
    t = simulate(two)
    assert t.step_s == 8.5 and t.stalls == (0, 0, 1, 0, 0, 1) and t.hop_s == 0.5
    one = simulate([Step(1, 2)] * 6)
    assert one.step_s == 12  # one copy stream: 6 copies of 2
    assert simulate([R(2), Step(3, None, 1, hop_s=0.5)]).step_s == 5.5


def test_a_plan_predicts_from_its_segments():
    MB = 1 << 20
    units = [PlanUnit("prelude", 10 * MB, compute_s=0.01)]
    units += [PlanUnit(f"blocks.{i}", 100 * MB, compute_s=0.05) for i in range(6)]
    units.append(PlanUnit("final", 10 * MB, compute_s=0.01))
    plan = build_plan(units, 420 * MB)
    assert plan.slots == 2 and plan.streamed_order
    bw = 1000 * MB  # 0.1 s per block
    steps = plan_steps(plan, bw)
    assert [s.copy_s is None for s in steps] == [seg.resident for seg in plan.segments]
    assert sum(s.compute_s for s in steps) == pytest.approx(0.32)
    assert sum(s.copy_s or 0 for s in steps) == pytest.approx(plan.streamed_bytes_per_forward / bw)
    sync = predict(plan, bw, overlap=False)
    assert sync.step_s == pytest.approx(0.32 + plan.streamed_bytes_per_forward / bw)
    assert predict(plan, bw).step_s <= sync.step_s


def test_a_plan_without_compute_times_cannot_be_predicted():
    plan = build_plan([PlanUnit("a", 10), PlanUnit("b", 10)], 1000)
    with pytest.raises(ValueError, match="compute times"):
        predict(plan, 1e9)


def test_a_call_walked_entry_by_entry_is_the_per_segment_timeline_where_nothing_loops():
    """``walk`` (the schedule followed entry by entry over the slots, as the executor walks it)
    and ``simulate`` (one step per segment, each copy into the slot ``slots`` places before it)
    are one model where each group is entered once a call: 300 random plans, one or two slots,
    in a session or not, with a fixed cost per copy or none, give the same steady and first call."""
    rng = random.Random(38)
    for _ in range(300):
        n = rng.randint(3, 9)
        units = [PlanUnit(f"blocks.{i}", rng.choice([1, 2, 4, 8]) * 1000, compute_s=rng.choice([1, 2, 5, 20]) * 1e-4)
                 for i in range(n)]
        res = {i for i in range(1, n) if rng.random() < 0.4}
        slots, session, bps, lat = rng.choice([1, 2]), rng.random() < 0.6, rng.choice([1e6, 1e7, 1e8]), rng.choice([0, 1e-4])
        size = max(units[i].weight_bytes for i in range(n) if i not in res)
        plan = plan_from_residency(units, 10**9, PlanOptions(), res, slots, size)
        tl = predict(plan, bps, session=session, latency_s=lat)
        calls = walk.call_times(plan, bps, session, lat)
        assert calls[-1][0] == pytest.approx(tl.step_s, rel=1e-9)
        assert calls[0][0] == pytest.approx(tl.first_s, rel=1e-9)


def test_a_loop_is_entered_pass_after_pass():
    """A run of units entered the same number of times is a loop over that run."""
    units = [PlanUnit("pre", 10, compute_s=1.0), PlanUnit("a", 10, calls=3, compute_s=3.0),
             PlanUnit("b", 10, calls=3, compute_s=6.0), PlanUnit("post", 10, compute_s=1.0)]
    plan = plan_from_residency(units, 10**6, PlanOptions(), {0, 3}, 2, 10)
    assert walk.entries(plan) == [("pre", 1.0)] + [("a", 1.0), ("b", 2.0)] * 3 + [("post", 1.0)]
    assert walk.looped(plan) and not walk.looped(plan_from_residency(units, 10**6, PlanOptions(), {1, 2}, 2, 10))
