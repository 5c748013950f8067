"""One model across 2 and 4 simulated GPUs (``EngineConfig.devices``).

Each device has its own allocator, compute stream and copy stream in the simulator; an operator
on device memory of two devices fails as CUDA's do, and a copy to another device is a peer copy
ordered as torch orders it (events on both devices' current streams, no host sync). Checked for
a UNet (skip connections concatenated outside any block), an MMDiT (two streams, ``vec``/``pe``
from the prelude read by every block) and a video DiT: outputs bit-equal to the unpatched model on
forwards 1..5, each device's reserved peak within its own budget from the first forward, no
hazard (no read of a slot or a hop before its copy), no host sync in a steady forward, the hops
the plan shows are the peer copies that ran, and the model unchanged after (and after an
exception mid-forward). One device named in ``devices`` is today's path exactly.
"""
import dataclasses
import gc

import pytest
import torch

from sim_cuda import ROUND, simulated_cuda
from test_sim_cuda import assert_restored, probe_plan, values
from toys import MMDiTLike, OptionsDiT, UNetLike, VideoDiTLike, seeded
from vramcut_core import BudgetError, Engine, EngineConfig, find_units


def _g(seed):
    return torch.Generator().manual_seed(seed)


FAMILIES = {
    "unet": (lambda: seeded(UNetLike(ch=32, levels=3)),
             lambda: (torch.randn(1, 4, 8, 8, generator=_g(1)), torch.rand(1, generator=_g(2)))),
    "mmdit": (lambda: seeded(MMDiTLike(d=32, n_double=4, n_single=6)),
              lambda: (torch.randn(2, 6, 16, generator=_g(1)), torch.randn(2, 3, 12, generator=_g(2)),
                       torch.rand(2, generator=_g(3)), torch.randn(1, 9, 2, generator=_g(4)))),
    "video": (lambda: seeded(VideoDiTLike(d=32, depth=8)),
              lambda: (torch.randn(1, 4, 3, 4, 4, generator=_g(1)), torch.rand(1, generator=_g(2)),
                       torch.randn(1, 5, 12, generator=_g(3)))),
    # blocks writing into a dict and a list their caller made (ComfyUI's transformer_options)
    "options": (lambda: seeded(OptionsDiT(d=32, depth=8)),
                lambda: (torch.randn(2, 6, 12, generator=_g(1)),)),
    "options_mixed": (lambda: seeded(OptionsDiT(d=32, depth=8, mix=True)),
                      lambda: (torch.randn(2, 6, 12, generator=_g(1)),)),
}


@pytest.fixture(params=[2, 4], ids=["2gpu", "4gpu"])
def simn(request, monkeypatch):
    with simulated_cuda(monkeypatch, devices=request.param) as s:
        yield s
        gc.collect()   # masters page-locked in this simulator are let go inside it
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


@pytest.fixture
def sim2(monkeypatch):
    with simulated_cuda(monkeypatch, devices=2) as s:
        yield s
        gc.collect()   # masters page-locked in this simulator are let go inside it
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


def setup(sim, family):
    """The toy in host memory, its inputs on the home device (cuda:0), its plain output."""
    build, inputs = FAMILIES[family]
    with sim.host_memory(), torch.no_grad():
        model = build()
        ref = model(*inputs())
    args = tuple(a.clone() for a in inputs())   # made outside host memory: device memory of cuda:0
    return model, args, ref


def budgets(model, args, n):
    """Per-device budgets that hold about a share of the weights each beside the activations and
    a streaming window: every device is needed, and some units stream."""
    us = find_units(model)
    biggest = max(u.weight_bytes for u in us.units)
    act = probe_plan(model, *args).activation_reserve_bytes
    b = int(us.weight_bytes * 0.4 / n) + act + 2 * biggest
    return [(f"cuda:{i}", b) for i in range(n)]


def engine(devs, model, home="cuda:0"):
    return Engine(model, EngineConfig(budget_bytes=sum(b for _, b in devs), device=home, devices=tuple(devs)))


def fresh(sim):
    bases = {}
    for d, a in sim.allocs.items():
        a.empty_cache()
        a.reset_peak()
        bases[d] = a.reserved
    return bases


def peaks_within(sim, devs, bases, held=()):
    slack = sum(-(-o.untyped_storage().nbytes() // ROUND) * ROUND for o in held)
    for i, (d, b) in enumerate(devs):
        a = sim.allocs[i]
        assert a.max_reserved - bases[i] <= b + (slack if i == 0 else 0), \
            f"{d}: reserved peak {a.max_reserved - bases[i]} B over its budget {b} B; at the peak: {a.at_peak}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_across_devices_bit_exact_within_each_budget_no_sync(simn, family):
    sim = simn
    n = sim.n_devices
    model, args, ref = setup(sim, family)
    snap = values(model)
    with torch.no_grad():
        devs = budgets(model, args, n)
        eng = engine(devs, model)
        bases = fresh(sim)
        outs, syncs, peers = [], [], []
        with eng.session():
            for _ in range(5):
                s0, p0 = sim.host_syncs, len(sim.peer_copies)
                outs.append(eng.run(model, *args))
                syncs.append(sim.host_syncs - s0)
                peers.append(sim.peer_copies[p0:])
        assert_restored(model, snap, sim)
    for i, o in enumerate(outs):
        assert torch.equal(o, ref), f"{family}: forward {i + 1} differs from the unpatched model"
        assert sim.device_of(o) == torch.device("cuda:0"), "the output must return on the home device"
    assert syncs[1:] == [0] * 4, f"host syncs per steady forward: {syncs}"
    peaks_within(sim, devs, bases, held=outs)
    pl = eng.placement
    assert len(pl.used) >= n - 1, f"the devices take units: {[(d.device, d.first, d.stop) for d in pl.used]}"
    js = eng.describe()["plan"]
    assert [d["device"] for d in js["devices"]] == [d for d, _ in devs]
    used = {d.device for d in pl.used}
    for d, (_, b) in zip(js["devices"], devs):
        assert d["peak_bytes"] <= b and (d["measured_peak_bytes"] is not None) == (d["device"] in used)
    # the hops the plan shows are the peer copies the last forward made
    assert js["hop_bytes_per_call"] == sum(nb for _, _, nb in peers[-1]) > 0
    assert {(h["src"], h["dst"]) for h in js["hops"]} == {(f"cuda:{s}", f"cuda:{d}") for s, d, _ in peers[-1]}
    assert js["hop_rule"] == ("home" if family in ("unet", "options_mixed") else "keep")
    for d in pl.used:
        assert sim.allocs[torch.device(d.device).index].high_allocated > 0, f"{d.device} was never used"
    assert eng.held_bytes == 0


def test_dit_hops_once_per_cut_and_keeps_vec_moved_once(sim2):
    """With the keep rule, a chain of blocks crosses once per cut (plus the output home), and a
    tensor every block reads (vec, pe) moves once per forward, not once per block."""
    model, args, ref = setup(sim2, "mmdit")
    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = engine(devs, model)
        with eng.session():
            for _ in range(2):
                out = eng.run(model, *args)
    assert torch.equal(out, ref)
    hops = eng.describe()["plan"]["hops"]
    cut = eng.placement.used[1]
    into = [h for h in hops if h["dst"] == "cuda:1"]
    assert {h["unit"] for h in into} <= {eng.placement.units[i].name for i in range(cut.first, cut.stop)}
    assert [h for h in hops if h["dst"] == "cuda:0"] == [
        {"src": "cuda:1", "dst": "cuda:0", "unit": "output", "bytes": out.untyped_storage().nbytes()}]
    moved = sum(1 for h in hops)
    assert moved <= 3, hops   # the stream(s) at the cut, vec/pe once, the output


def test_unet_skip_connections_would_mix_devices_without_the_home_rule(sim2):
    """The simulator fails an operator on two devices' memory, as CUDA does: a UNet run with the
    keep rule (outputs left where computed) concatenates a skip connection of one device with a
    tensor of another; the dry run on fake devices finds that before anything moves."""
    from vramcut_core.devices import check_hops, unit_devices

    model, args, ref = setup(sim2, "unet")
    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = engine(devs, model)
        sig_plan = eng.preview_as(("x",), model, *args)  # traced figures (one device)
        del sig_plan
        meas = dict(eng.traces[("x",)].measurements)
        pl = eng.side._place(meas, None)
        placed = unit_devices(pl, eng.planner.unit)
        check = check_hops(model, placed, torch.device("cuda:0"), model, args, {})
        assert check.rule == "home" and "keep" in check.reasons and "device" in check.reasons["keep"]
        # forcing the keep rule at run time fails in the model's own code, nothing left behind
        with pytest.raises(RuntimeError, match="same device"):
            eng.group.forward(pl, eng.planner.unit, "keep", model, args, {})
    assert eng.held_bytes == 0


def test_sim_catches_operator_on_two_devices(sim2):
    a = torch.ones(4)
    b = torch.ones(4, device=torch.device("cpu", 1))  # the placement seam's cuda:1
    assert sim2.device_of(a) == torch.device("cuda:0") and sim2.device_of(b) == torch.device("cuda:1")
    with pytest.raises(RuntimeError, match="same device"):
        a + b


def test_sim_peer_copy_orders_the_consumer_without_a_host_sync(sim2):
    a = torch.ones(256)
    s0 = sim2.host_syncs
    b = a.to(torch.device("cpu", 1), copy=True)
    c = b * 2   # on cuda:1's stream, after the copy
    assert sim2.device_of(b) == torch.device("cuda:1") and sim2.device_of(c) == torch.device("cuda:1")
    assert bool(c.eq(2.0).all()) and sim2.host_syncs == s0
    assert sim2.peer_copies == [(0, 1, 1024)] and sim2.allocs[1].allocated > 0


@pytest.mark.parametrize("family", ["mmdit", "unet"])
def test_exception_mid_forward_leaves_the_model_unchanged(sim2, family):
    model, args, ref = setup(sim2, family)
    snap = values(model)
    units = find_units(model).units
    late = units[-2].hook_modules[-1]   # a module the forward calls (a UNet never calls its blocks)

    def boom(*_a):
        raise KeyError("interrupted")

    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = engine(devs, model)
        with eng.session():
            eng.run(model, *args)
            h = late.register_forward_pre_hook(boom)
            with pytest.raises(KeyError):
                eng.run(model, *args)
            h.remove()
            out = eng.run(model, *args)
        assert_restored(model, snap, sim2)
    assert torch.equal(out, ref)
    assert eng.held_bytes == 0 and not eng.running
    assert not model._forward_pre_hooks and all(not m._forward_pre_hooks and not m._forward_hooks
                                                for m in model.modules())


def test_one_device_in_devices_is_todays_path(sim2):
    """``devices`` naming one device plans and runs exactly as no devices."""
    runs, b = [], None
    for devices in ((), "one"):
        model, args, ref = setup(sim2, "mmdit")
        with torch.no_grad():
            b = b or budgets(model, args, 2)[0][1]
            cfg = EngineConfig(budget_bytes=b, device="cuda:0", devices=(("cuda:0", b),) if devices else ())
            eng = Engine(model, cfg)
            with eng.session():
                outs = [eng.run(model, *args) for _ in range(3)]
        assert eng.group is None and eng.placement is None
        js = eng.describe()["plan"]
        # (activations measured in a second engine in one simulator differ with the allocator's
        # cache; the plan's structure and what it streams may not)
        js = {k: v for k, v in js.items() if k not in ("stats", "steady_stats", "units", "activation_reserve_bytes",
                                                         "peak_bytes")}
        js["segments"] = [(s["units"], s["resident"], s["weight_bytes"]) for s in js["segments"]]
        runs.append((outs, js))
    (o1, j1), (o2, j2) = runs
    assert all(torch.equal(a, b) for a, b in zip(o1, o2))
    assert j1 == j2 and "devices" not in j1 and "hops" not in j1


def test_budgets_too_small_in_total_are_refused_before_anything_moves(sim2):
    model, args, _ = setup(sim2, "video")
    with torch.no_grad():
        eng = engine([("cuda:0", 40_000), ("cuda:1", 40_000)], model)
        with pytest.raises(BudgetError, match="same proportions") as e:
            eng.run(model, *args)
    assert e.value.device_budgets is not None
    assert sim2.allocs[0].high_allocated < 40_000 and sim2.allocs[1].high_allocated == 0


def test_no_dry_run_refuses_naming_one_device(sim2, monkeypatch):
    import vramcut_core.engine as engine_mod
    from vramcut_core.figures.trace import TraceResult

    monkeypatch.setattr(engine_mod, "trace_units", lambda *a, **k: TraceResult(None, 0, "RuntimeError: no fakes"))
    model, args, _ = setup(sim2, "video")
    with torch.no_grad():
        eng = engine(budgets(model, args, 2), model)
        with pytest.raises(BudgetError, match=r"needs the dry run.*no fakes.*devices=cuda:0=GIB"):
            eng.run(model, *args)
    assert sim2.allocs[1].high_allocated == 0


@pytest.mark.parametrize("kw,match", [
    (dict(budget_bytes=20, device="cuda:2", devices=(("cuda:0", 10), ("cuda:1", 10))), "home device"),
    (dict(budget_bytes=20, device="cuda:0", devices=(("cuda:0", 10), ("cuda:0", 10))), "named twice"),
    (dict(budget_bytes=9, device="cuda:0", devices=(("cuda:0", 10), ("cuda:1", -1))), "positive int"),
    (dict(budget_bytes=20, device="cuda:0", devices=(("cuda", 10), ("cuda:1", 10))), "index"),
    (dict(budget_bytes=7, device="cuda:0", devices=(("cuda:0", 10), ("cuda:1", 10))), "summed"),
], ids=["home", "twice", "negative", "no-index", "sum"])
def test_config_devices_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_other_engines_on_the_module_release_but_the_group_coexists(sim2):
    model, args, ref = setup(sim2, "video")
    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = engine(devs, model)
        with eng.session():
            eng.run(model, *args)
            held = eng.held_bytes_by_device
            assert held["cuda:0"] > 0 and held["cuda:1"] > 0
            other = Engine(model, EngineConfig(budget_bytes=1 << 30, device="cuda:0"))
            assert torch.equal(other.run(model, *args), ref)
            assert eng.held_bytes == 0   # gave its buffers back to the other engine
            assert torch.equal(eng.run(model, *args), ref)


@pytest.mark.parametrize("family", ["mmdit", "video"])
def test_across_devices_residency_by_time_within_each_budget(sim2, family):
    """With residency chosen by time (``speed="time"``, the bandwidth and throughput given), each
    device's plan carries its units' compute times and is ``residency.by_time``'s under its own
    budget (never slower under the model than the count-based plan of the same units); each
    device's reserved peak stays within its budget and the output is bit-equal."""
    from vramcut_core.planning.plan import make_plan
    from vramcut_core.planning.residency import by_time
    from vramcut_core.planning.timeline import predict

    sim = sim2
    model, args, ref = setup(sim, family)
    bps = 1e9
    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = Engine(model, EngineConfig(budget_bytes=sum(b for _, b in devs), device="cuda:0", devices=tuple(devs),
                                         speed="time", bandwidth_bytes_per_s=bps, flops_per_s=1e9))
        bases = fresh(sim)
        with eng.session():
            outs = [eng.run(model, *args) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    peaks_within(sim, devs, bases, held=outs)
    used = eng.placement.used
    assert len(used) == 2
    for d in used:
        p = d.plan
        assert p.time is not None and all(u.compute_s is not None for u in p.units if u.entered)
        count = make_plan(list(p.units), d.budget_bytes, eng.planner.options)
        assert p == dataclasses.replace(by_time(count, bps, eng.planner.options, overlap=True), time=p.time,
                                        source=p.source)
        # (both with the executor's own cost of a call, measured: executor.call_seconds)
        assert p.time.predicted_s <= predict(count, bps, call_s=eng.planner.figures.call_s(eng.config)).step_s + 1e-12
        assert p.peak_bytes <= d.budget_bytes


class _StashBlock(torch.nn.Module):
    """A block that reads a tensor its model sets on it (an attribute, not an argument: no hop
    moves it), or that refuses any GPU but the first, as a kernel written for one device may."""

    def __init__(self, d: int, first_gpu_only: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.first_gpu_only = first_gpu_only
        self.extra = None

    def forward(self, x):
        if self.first_gpu_only and x.device.index not in (None, 0):
            raise NotImplementedError(f"this kernel runs on the first GPU only, not {x.device}")
        h = x + self.fc2(torch.relu(self.fc1(x)))
        return h if self.extra is None else h + self.extra


class _StashModel(torch.nn.Module):
    def __init__(self, d: int = 32, depth: int = 6, stash: bool = True, first_gpu_only: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(_StashBlock(d, first_gpu_only) for _ in range(depth))
        self.stash = stash

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            b.extra = x.mean(-1, keepdim=True) if self.stash else None   # on the device of the model's input
            x = b(x)
        return x


@pytest.mark.parametrize("kind,match", [
    ("mixes", r"mixes tensors of different devices.*keep: FakeTensorDeviceMismatchError.*"
              r"home: FakeTensorDeviceMismatchError.*devices=cuda:0=GIB"),
    ("raises", r"the dry run across devices could not run: NotImplementedError: this kernel runs on the first GPU "
               r"only, not cuda:1; name one device \(devices=cuda:0=GIB"),
], ids=["mixes-devices", "other-error"])
def test_dry_run_across_devices_failure_names_what_failed(sim2, kind, match):
    """Only a device mismatch in the dry run on fake devices says the model mixes devices; any
    other error is reported as it is (and no other rule is tried); both refuse before anything
    moves to the second device, naming one device as the way out."""
    from vramcut_core.devices import check_hops, unit_devices

    with sim2.host_memory(), torch.no_grad():
        torch.manual_seed(0)
        model = _StashModel(stash=kind == "mixes", first_gpu_only=kind == "raises")
    args = (torch.randn(2, 5, 32),)
    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = engine(devs, model)
        with pytest.raises(BudgetError, match=match):
            eng.run(model, *args)
        assert sim2.allocs[1].high_allocated == 0
        (trace,) = eng.traces.values()
        pl = eng.side._place(dict(trace.measurements), None)
        check = check_hops(model, unit_devices(pl, eng.planner.unit), torch.device("cuda:0"), model, args, {})
    assert check.rule is None
    if kind == "mixes":
        assert check.error is None and set(check.reasons) == {"keep", "home"}
    else:
        assert check.error.startswith("NotImplementedError") and check.reasons == {}


class _CurrentDeviceBlock(torch.nn.Module):
    """A block that makes a tensor where its input is and mixes the two, as ComfyUI's attention
    does (``torch.empty(..., device=query.device)`` before a ``baddbmm``). In the simulator a
    tensor made outside host memory is the current device's, as one made on "the" CUDA device
    (``device="cuda"``, a stream or generator taken without naming a device) is on a GPU."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(torch.cuda.current_device())
        return x + self.fc(x) * torch.full((x.shape[-1],), 0.5, device=x.device)


class _CurrentDeviceModel(torch.nn.Module):
    def __init__(self, d: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_CurrentDeviceBlock(d) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_unit_on_another_gpu_computes_with_its_device_current(sim2):
    """While a unit placed on cuda:1 computes, cuda:1 is the current device (what the model makes
    on "the" CUDA device is made where the unit computes), and the caller's current device is
    back after each unit, after the forward and after an error inside a unit."""
    with sim2.host_memory(), torch.no_grad():
        torch.manual_seed(0)
        model = _CurrentDeviceModel()
        x = torch.randn(2, 5, 32)
        ref = model(x)
    for b in model.blocks:
        b.seen.clear()
    args = (x.clone(),)   # made outside host memory: device memory of cuda:0
    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = engine(devs, model)
        with eng.session():
            outs = [eng.run(model, *args) for _ in range(3)]
        assert all(torch.equal(o, ref) for o in outs)
        placed = {eng.placement.units[i].name: int(d.device[-1]) for d in eng.placement.used
                  for i in range(d.first, d.stop)}
        assert set(placed.values()) == {0, 1}
        for i, b in enumerate(model.blocks):
            assert b.seen and set(b.seen[-3:]) == {placed[f"blocks.{i}"]}, (i, b.seen)
        assert sim2.current_device == 0

        last = model.blocks[-1]
        boom = last.fc.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
        try:
            with pytest.raises(RuntimeError, match="boom"):
                eng.run(model, *args)
        finally:
            boom.remove()
        assert sim2.current_device == 0


def test_device_budgets_that_move_are_placed_again_once_within_them(sim2):
    """A ``free`` device budget read again before each call (``Engine.set_devices``): a wobble
    keeps the placement; another program taking memory on cuda:1 below the plan's peak there
    places again from the measurements (no forward measures again), within the smaller budget,
    output unchanged, the plan saying why; memory given back well past the margin places again
    with fewer bytes from host memory."""
    model, args, ref = setup(sim2, "video")
    with torch.no_grad():
        devs = budgets(model, args, 2)
        eng = engine(devs, model)
        with eng.session():
            for _ in range(2):
                assert torch.equal(eng.run(model, *args), ref)
            first = eng.placement
            measured = eng.stats.forwards - eng.steady_stats.forwards

            wobble = [(d, b - (b // 100)) for d, b in devs]
            eng.set_devices(wobble)
            assert torch.equal(eng.run(model, *args), ref)
            assert eng.placement is first, "a wobble of 1 % keeps the placement"

            (d0, b0), (d1, _) = devs
            part1 = next(d for d in first.used if d.device == d1)
            taken = [(d0, b0), (d1, part1.plan.peak_bytes - (part1.plan.peak_bytes // 5))]
            eng.set_devices(taken)
            bases = fresh(sim2)
            for _ in range(2):
                assert torch.equal(eng.run(model, *args), ref)
            peaks_within(sim2, taken, bases)
            again = eng.placement
            assert again is not first and dict((d.device, d.plan.peak_bytes) for d in again.used).get(d1, 0) \
                <= taken[1][1]
            assert eng.stats.forwards - eng.steady_stats.forwards == measured, "placed again without measuring"
            assert "cuda:1: the budget fell" in eng.describe()["plan"]["refit"]["reason"]

            roomy = [(d, b * 3) for d, b in devs]
            eng.set_devices(roomy)
            assert torch.equal(eng.run(model, *args), ref)
            assert eng.placement.host_bytes_per_forward < again.host_bytes_per_forward
    with pytest.raises(ValueError, match="same devices"):
        eng.set_devices([("cuda:1", 1 << 30), ("cuda:0", 1 << 30)])
