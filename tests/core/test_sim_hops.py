"""A plan over two simulated devices timed by the timeline (``timeline.predict_devices``) against
the executors that run it (``devices.DeviceGroup``, one per device, the hops between them).

The model is a stack of MLP blocks (``timed_plans``) cut in two: the first blocks on cuda:0, the
rest on cuda:1, each device's part with its own residency and slots. The simulator times copies
from host memory over a link, peer copies (a hop: ``tensor.to`` another device) over another and
operators by their FLOPs; the hops predicted are the ones that ran (``Hops.summary``: the residual
stream into cuda:1's first block, the output back home), each at the peer rate.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import timed_plans as tp
from sim_cuda import flop_seconds
from test_sim_multi_gpu import sim2  # noqa: F401  (the fixture)
from vramcut_core import SegmentedExecutor
from vramcut_core.devices import DeviceGroup
from vramcut_core.planning import timeline
from vramcut_core.planning.placement import DevicePlan, Placement
from vramcut_core.runtime.hops import KEEP

BPS = 2e7


def placed(case, shapes: tuple[str, str], slots: tuple[int, int]) -> Placement:
    """Each device's part of the stack with its residency ("S R", one letter a block) and slots."""
    parts, first = [], 0
    for i, (shape, n) in enumerate(zip(shapes, slots)):
        stop = first + len(shape.split())
        sub = tp.Case(case.model, case.x, case.ref, case.units[first:stop], case.lookup)
        plan = tp.plan_of(sub, shape, n)
        parts.append(DevicePlan(f"cuda:{i}", plan.budget_bytes, first, stop, plan))
        first = stop
    return Placement(tuple(case.units), tuple(parts), ())


def run_calls(sim, case, pl: Placement, calls: int, session: bool, peer_bps: float):
    """Seconds of each call on the two devices (from one call's end on cuda:0 to the next's),
    outputs checked bit-equal, and the hops that ran: (src, dst, unit, bytes)."""
    sim.set_durations(copy_bytes_per_s=BPS, op_seconds=flop_seconds(tp.FLOPS), peer_bytes_per_s=peer_bps)
    group = DeviceGroup(lambda d: SegmentedExecutor(case.lookup, d, module=case.model),
                        [(d.device, d.budget_bytes) for d in pl.devices], "cuda:0")
    x = case.x.clone()   # made outside host memory: on cuda:0
    out, t = [], sim.compute.t
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if session:
            for ex in group.executors:
                stack.enter_context(ex.session())
        for _ in range(calls):
            y, _stats, _ = group.forward(pl, case.lookup, KEEP, case.model, (x,), {})
            assert torch.equal(y, case.ref)
            end = max(sim.compute.t, sim.host_t)
            out.append(end - t)
            t = end
    for ex in group.executors:
        ex.release()
    index = {f"cuda:{i}": i for i in range(2)}
    moved = [(index[h["src"]], index[h["dst"]], h["unit"], h["bytes"]) for h in group.last_hops.summary()]
    return out, moved


CASES = [(("S S", "S S"), (2, 2), 1e7), (("R S", "S R"), (1, 2), 1e6), (("S S S", "R S"), (2, 1), 2e5),
         (("R R", "S S S"), (2, 2), 1e6)]


@pytest.mark.parametrize("session", [True, False], ids=["session", "outside"])
@pytest.mark.parametrize("shapes,slots,peer", CASES, ids=[f"{a.replace(' ', '')}-{b.replace(' ', '')}-{p:g}"
                                                         for (a, b), _, p in CASES])
def test_two_devices_are_predicted_with_their_hops(sim2, shapes, slots, peer, session):
    """Each device streams its part through its own slots and copy stream while the other
    computes; the residual stream hops to cuda:1 before its first block computes (the peer copy
    waits for cuda:1's compute queued before it: its copy waited for) and the output hops home.
    Steady call within 1 %, first within 5 %."""
    n = sum(len(s.split()) for s in shapes)
    case = tp.build(sim2, [tp.Block(256, 1) for _ in range(n)])
    pl = placed(case, shapes, slots)
    times, moved = run_calls(sim2, case, pl, 3, session, peer)
    assert [m[:3] for m in moved] == [(0, 1, case.units[len(shapes[0].split())].name), (1, 0, "output")]
    plans = [d.plan for d in pl.devices]
    links = {(0, 1): (peer, 0.0), (1, 0): (peer, 0.0)}
    tl = timeline.predict_devices(plans, moved, BPS, links, session=session)
    assert times[-1] == pytest.approx(tl.step_s, rel=0.01)
    assert times[0] == pytest.approx(tl.first_s, rel=0.05)
    assert tl.hop_s == pytest.approx(sum(m[3] for m in moved) / peer)
    if peer < 1e6:  # a slow link: the hops are most of the call, and a model without them is far off
        assert timeline.predict_devices(plans, [], BPS, links, session=session).step_s < 0.5 * times[-1]


def test_a_two_gpu_plan_carries_the_modelled_call(sim2, tmp_path, monkeypatch):
    """The engine on two simulated GPUs with residency by time: the link between them measured by
    the probe (``bandwidth.device_to_device``: a large and a small peer copy, fitted; here the
    simulator's peer rate and no fixed cost), the plan it reports carries the placement's modelled
    call (``timeline.predict_devices``, hops included), which is the steady call the executors
    then run, within 1 %. Before, a plan across devices carried no predicted call at all."""
    from vramcut_core import Engine, EngineConfig
    from vramcut_core.figures import bandwidth

    monkeypatch.setenv(bandwidth.CACHE_ENV, str(tmp_path))
    bandwidth.forget()
    peer = 1e6
    sim2.set_durations(copy_bytes_per_s=BPS, op_seconds=flop_seconds(tp.FLOPS), peer_bytes_per_s=peer)
    for a, b in (("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")):
        got = bandwidth.device_to_device(a, b)
        assert got["source"] == "measured" and got["bytes_per_s"] == pytest.approx(peer, rel=1e-6)
        assert got["latency_s"] == pytest.approx(0.0, abs=1e-9)
    case = tp.build(sim2, [tp.Block(256, 1) for _ in range(8)])
    unit = max(u.weight_bytes for u in case.units)
    devs = (("cuda:0", 4 * unit), ("cuda:1", 3 * unit))
    eng = Engine(case.model, EngineConfig(budget_bytes=7 * unit, device="cuda:0", devices=devs, speed="time",
                                          bandwidth_bytes_per_s=BPS, flops_per_s=tp.FLOPS))
    x = case.x.clone()
    with torch.no_grad(), eng.session():
        for _ in range(4):
            t = max(sim2.compute.t, sim2.host_t)
            assert torch.equal(eng.run(case.model, x), case.ref)
        last = max(sim2.compute.t, sim2.host_t) - t
    j = eng.describe()["plan"]
    assert len(j["devices"]) == 2 and j["hops_per_call"] == 2 and j["time"]["predicted_s"] > 0
    assert j["devices"][0]["streamed_bytes_per_call"] > 0   # the home device streams, cuda:1 holds its part
    assert j["time"]["predicted_s"] == pytest.approx(last, rel=0.01)   # 18.35 ms for 18.31 ms
    # each device's own prediction summed, without the hops (all a two-GPU plan had before): 16.56 ms
    assert sum(d.plan.time.predicted_s for d in eng.placement.used) < 0.95 * last
    bandwidth.forget()
