"""One model across 2 and 4 simulated GPUs through the ComfyUI adapter (issue 31).

A tiny model of each family the host runs (an SD1.5-style UNet through the host's model config,
an SD3 MMDiT and a Wan 2.1 video DiT through the host's loader) is patched by the Max VRAM node
with a Devices node connected, loaded by the host (``load_models_gpu``: its ``model_size``, its
``load`` / ``partially_load``) and called through the host's ``apply_model`` with the pack's
wrappers around the run (ON_PRE_RUN, OUTER_SAMPLE, APPLY_MODEL, ON_CLEANUP), on the simulated
accelerator (``tests/sim_cuda.py``; the host believes its main device is ``cuda:0``). Checked:

* each call's output is bit-equal to the unpatched model's, with an attention patch that writes
  into the forward's ``transformer_options`` inside every block (what the next block reads);
* each device's reserved peak stays within its own budget on every call, the first included;
* no host sync in a steady call, and no hazard (no read of a slot or a hop before its copy);
* the plan's JSON, and the node's entry after the run, carry the devices and the hops;
* the weights live where the plan says: while a unit computes, every one of its weights is
  memory of the device the placement gave it, and every device the placement uses was used
  (a donor device's allocation silently not used, ComfyUI-MultiGPU's DisTorch2 failure under
  dynamic VRAM, would fail here); the host's load moved no weight and holds nothing on any
  device; after the run every weight is the host's own tensor again, and once the host unloads
  the model nothing is held on any device;
* the same with the host's dynamic-VRAM patcher having loaded the model its way first: none of
  its virtual weight ranges is on a module while VRAMCut computes.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Callable

import pytest
import torch

import tiny_models as tm
from host_cases import sampling, simulated_host
from pack_nodes import run_node
from sim_cuda import ROUND

GIB = 1 << 30
CALLS = 4


@pytest.fixture(params=[2, 4], ids=["2gpu", "4gpu"])
def simn(request, monkeypatch, pack):
    """``n`` simulated GPUs, the host's main device ``cuda:0`` (what a CUDA host answers)."""
    with simulated_host(monkeypatch, pack, devices=request.param) as s:
        yield s


# ------------------------------------------------------------------------------ the families


def _g(seed):
    return torch.Generator().manual_seed(seed)


@dataclasses.dataclass
class Family:
    load: Callable
    inputs: Callable   # -> (x, sigma, conditions by name)


FAMILIES = {
    "sd15_unet": Family(tm.load_tiny_sd15_unet, lambda: (torch.randn(1, 4, 8, 8, generator=_g(1)), torch.full((1,), 2.5),
                                            {"c_crossattn": torch.randn(1, 6, 32, generator=_g(2))})),
    "sd3_mmdit": Family(lambda: tm.load_tiny_sd3(depth=4, seed=1),
                        lambda: (torch.randn(1, 16, 8, 8, generator=_g(1)), torch.full((1,), 0.7),
                                 {"c_crossattn": torch.randn(1, 8, 32, generator=_g(2)),
                                  "y": torch.randn(1, 32, generator=_g(3))})),
    "wan21_video": Family(lambda: tm.load_tiny_wan21(seed=1, num_layers=4),
                          lambda: (torch.randn(*tm.WAN_LATENT_SHAPE, generator=_g(1)), torch.full((1,), 0.7),
                                   {"c_crossattn": torch.randn(1, 8, tm.WAN_TEXT_DIM, generator=_g(2))})),
}


def writing_override(func, *args, **kwargs):
    """An attention override (the host's ``optimized_attention_override``, what attention patches
    install) that writes inside each block into the state its call's ``transformer_options``
    carry: a counter in a dict and an item appended to a list. The next attention call reads
    them, and so does the caller after the forward (as a wrapper or a cache would): a block whose
    writes land in a rebuilt copy of its options changes the output."""
    state = kwargs["transformer_options"]["vramcut_test"]
    state["calls"] += 1
    state["trail"].append(state["calls"])
    out = func(*args, **kwargs)
    return out * (1.0 + 0.01 * state["calls"] + 0.001 * len(state["trail"]))


def apply(base, x, sigma, conds, **options):
    """The host's ``apply_model`` with the writing patch in a call's own ``transformer_options``
    (the host copies the dict, not what it holds), the output folded with what the blocks wrote."""
    state = {"calls": 0, "trail": []}
    out = base.apply_model(x, sigma, transformer_options={"optimized_attention_override": writing_override,
                                                          "vramcut_test": state, **options}, **conds)
    assert state["calls"] == len(state["trail"]) > 0, "the patch ran in the forward"
    return out * (1.0 + 0.01 * state["calls"]) + 0.001 * len(state["trail"])


def call(base, clone, inputs):
    """One step of the host's sampler: its ``apply_model`` with the patched model's wrappers and a
    patch that writes into ``transformer_options`` during the forward."""
    x, sigma, conds = inputs
    return apply(base, x, sigma, conds, wrappers=clone.wrappers)


class WeightPlaces:
    """Where each unit's weights are while the unit computes: a forward hook on each module owning
    a weight, registered before the engine's (hooks run in order, so the engine has bound the
    unit at the module's call and not yet let it go)."""

    def __init__(self, sim, units) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        self.seen: dict[str, set] = {}
        self.hooks = []

        def seen(unit, ref):
            t = ref.get()
            if not isinstance(t, FakeTensor):   # the dry run's fake weights are not where anything lives
                self.seen.setdefault(unit, set()).add(str(sim.device_of(t)))

        for u in units:
            for ut in u.tensors:
                for r in ut.refs:
                    self.hooks.append(r.owner.register_forward_hook(
                        lambda _m, _a, _o, _u=u.name, _r=r: seen(_u, _r)))

    def remove(self):
        for h in self.hooks:
            h.remove()


def device_budgets(pack, max_vram, patcher, sim, inputs):
    """The smallest budgets that work for this shape in equal proportions, as the engine suggests
    them when each device is given only the largest block's weights (refused: the block's
    activations and a streaming slot come on top): no device holds the model alone."""
    n = sim.n_devices
    biggest = max(u.weight_bytes for u in pack.vramcut_core.find_units(patcher.model.diffusion_model).units)
    (few,), _ = run_node(pack, "VRAMCutDevices", devices=", ".join(f"cuda:{i}={biggest / GIB:.9f}"
                                                                   for i in range(n)), reserve_gb=1.0)
    (clone, _, _), _ = max_vram(1.0, model=patcher, devices=few)
    with pytest.raises(ValueError) as e, torch.no_grad():
        sampling(clone, lambda: call(clone.model, clone, inputs))
    suggestion = getattr(e.value.__cause__, "device_budgets", None)
    assert suggestion, f"the engine suggests budgets per device: {e.value}"
    pack.nodes.state.state_of(clone).release()
    del clone, e
    gc.collect()   # the probe's clone goes now, not at a collection inside the measured calls
    return list(suggestion)


@pytest.mark.parametrize("kind", ["plain", "dynamic"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_host_model_across_devices_exact_within_each_budget_weights_where_planned(simn, pack, max_vram, family, kind,
                                                                                  monkeypatch):
    """``kind``: the host's plain patcher, or its dynamic-VRAM patcher (0.33+ on NVIDIA; the
    stand-in of ``tests/dynamic_host.py``) that has loaded the model its way first (virtual
    weight ranges on its layers, other parameters moved to the device with a backup), as an
    unpatched use of the model earlier in the workflow leaves it."""
    import comfy.model_management as mm

    import dynamic_host as dh

    sim, fam = simn, FAMILIES[family]
    n = sim.n_devices
    with sim.host_memory():
        patcher = fam.load()
        base = patcher.model
        host_inputs = fam.inputs()
        with torch.no_grad():
            ref = apply(base, *host_inputs)
    patcher.load_device = torch.device("cuda", 0)   # a CUDA host's load device
    x, sigma, conds = fam.inputs()                    # made outside host memory: cuda:0's memory
    inputs = (x, sigma, conds)
    host_tensors = {k: v for k, v in list(base.diffusion_model.named_parameters())
                    + list(base.diffusion_model.named_buffers())}
    if kind == "dynamic":
        monkeypatch.setattr(dh.DynamicStandIn, "place", staticmethod(pack.vramcut_core.runtime.device_memory._placement))
        patcher = dh.make_dynamic(patcher)
        mm.load_models_gpu([patcher])
        assert dh.dynamic_modules(base.diffusion_model) or patcher.backup, "the host loaded it its way"

    devs = device_budgets(pack, max_vram, patcher, sim, inputs)
    (devices,), _ = run_node(pack, "VRAMCutDevices", devices=", ".join(f"{d}={b / GIB:.9f}" for d, b in devs),
                             reserve_gb=1.0)
    budgets = dict(devices.budgets("cuda:0"))
    (clone, _, _), payload = max_vram(1.0, model=patcher, devices=devices)
    assert [d["device"] for d in payload["devices"]] == [f"cuda:{i}" for i in range(n)]

    # the host loads the patched model: ComfyUI frees the home device's budget, moves no weight
    assert clone.model_size() <= budgets["cuda:0"]
    for a in sim.allocs.values():
        a.empty_cache()
    bases = {i: a.reserved for i, a in sim.allocs.items()}
    mm.load_models_gpu([clone])
    assert any(lm.model is clone for lm in mm.current_loaded_models), "the host loaded the patched model"
    on_device = [k for k, t in host_tensors.items() if sim.is_device(t)]
    assert not on_device, f"the host's load moved weights to a device: {on_device[:5]}"
    assert all(sim.allocs[i].allocated == bases[i] == 0 for i in range(1, n)), "the host holds memory on a device"

    state = pack.nodes.state.state_of(clone)
    (engine,) = state.engines()
    places = WeightPlaces(sim, engine.unitset.units)
    dynamic_seen: list[str] = []   # the host's dynamic state on a module while VRAMCut computes
    places.hooks.append(base.diffusion_model.register_forward_pre_hook(
        lambda *_: dynamic_seen.extend(dh.dynamic_modules(base.diffusion_model))))
    outs, syncs, peaks = [], [], []

    def steps():
        for _ in range(CALLS):
            for a in sim.allocs.values():
                a.reset_peak()
            s0 = sim.host_syncs
            outs.append(call(base, clone, inputs))
            syncs.append(sim.host_syncs - s0)
            peaks.append({i: a.max_reserved - bases[i] for i, a in sim.allocs.items()})
        return outs

    try:
        with torch.no_grad():
            sampling(clone, steps)
    finally:
        places.remove()

    for i, o in enumerate(outs):
        assert torch.equal(o, ref), f"{family}: call {i + 1} differs from the unpatched model"
        assert sim.device_of(o) == torch.device("cuda", 0), "the output returns on the host's main device"
    held = sum(-(-o.untyped_storage().nbytes() // ROUND) * ROUND for o in outs)   # the outputs, on cuda:0
    for k, p in enumerate(peaks):
        for i in range(n):
            b = budgets[f"cuda:{i}"] + (held if i == 0 else 0)
            assert p[i] <= b, f"call {k + 1}: cuda:{i} reserved peak {p[i]} B over its budget {b} B"
    assert syncs[1:] == [0] * (CALLS - 1), f"host syncs per steady call: {syncs}"

    # the weights were where the plan put them, and every device the plan uses computed
    assert not dynamic_seen, f"the host's dynamic state on modules during a forward: {sorted(set(dynamic_seen))[:5]}"
    pl = engine.placement
    planned = {pl.units[j].name: d.device for d in pl.used for j in range(d.first, d.stop)}
    assert len(pl.used) >= 2, [(d.device, d.first, d.stop) for d in pl.used]
    wrong = {u: (seen, planned.get(u)) for u, seen in places.seen.items() if seen != {planned.get(u)}}
    assert not wrong, f"weights not where the plan says (seen, planned): {wrong}"
    assert {planned[u] for u in places.seen} == {d.device for d in pl.used}
    for d in pl.used:
        assert sim.allocs[torch.device(d.device).index].high_allocated > 0, f"{d.device} was never used"

    plan = engine.describe()["plan"]
    assert [d["device"] for d in plan["devices"]] == [f"cuda:{i}" for i in range(n)]
    assert plan["hops"] and plan["hop_bytes_per_call"] > 0
    assert {(h["src"], h["dst"]) for h in plan["hops"]} <= {(f"cuda:{s}", f"cuda:{d}") for s, d, _ in sim.peer_copies}
    if sum(budgets.values()) < sum(u.weight_bytes for u in engine.unitset.units):
        assert any(d["streamed_bytes_per_call"] > 0 for d in plan["devices"]), "some blocks stream"
    entry = state.report.payload["models"][0]
    assert entry["plan"]["devices"] and entry["plan"]["hops"] and entry["plan"]["cost"]["devices"] == n

    # after the run: the host's tensors again (the engines keep their device copies for the next
    # prompt); once the host unloads the model, nothing held on any device
    for k, t in list(base.diffusion_model.named_parameters()) + list(base.diffusion_model.named_buffers()):
        assert t is host_tensors[k] or torch.equal(t, host_tensors[k]), k
        assert not sim.is_device(t), k
    mm.unload_all_models()
    assert engine.held_bytes == 0


def test_a_free_device_budget_follows_what_another_program_takes(simn, pack, max_vram, monkeypatch):
    """``cuda:1=free``: each call reads that device's free memory again (plus what the engine
    holds there, less the reserve). Another program takes memory on cuda:1 between calls, below
    the plan's peak there: the next call is placed again, once, within what is left; the output
    stays the unpatched model's and the plan says why."""
    import comfy.model_management as mm

    sim = simn
    with sim.host_memory():
        patcher = FAMILIES["sd3_mmdit"].load()
        base = patcher.model
        host_inputs = FAMILIES["sd3_mmdit"].inputs()
        with torch.no_grad():
            ref = apply(base, *host_inputs)
    patcher.load_device = torch.device("cuda", 0)
    inputs = FAMILIES["sd3_mmdit"].inputs()
    devs = dict(device_budgets(pack, max_vram, patcher, sim, inputs))
    last = f"cuda:{sim.n_devices - 1}"

    other = {last: 0}   # what another program holds on a device
    total = sim.total_memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (
        total - sim.alloc_of(device).reserved - other.get(str(torch.device("cuda", sim.device_index(device, "x"))), 0),
        total))

    def leave(budget):   # another program leaves ``budget`` free on the last device (beside the engine)
        reading = int(mm.get_free_memory(torch.device(last)))
        other[last] += reading - budget

    text = ", ".join(f"{d}={b / GIB:.9f}" for d, b in devs.items() if d != last) + f", {last}=free"
    (devices,), _ = run_node(pack, "VRAMCutDevices", devices=text, reserve_gb=0.0)
    (clone, _, _), _ = max_vram(1.0, model=patcher, devices=devices)
    state = pack.nodes.state.state_of(clone)
    leave(int(devs[last] * 1.6))
    mm.load_models_gpu([clone])
    (engine,) = state.engines()
    outs, given, peaks = [], [], []
    set_devices = engine.set_devices

    def recording(budgets):
        given.append(dict(budgets)[last])
        return set_devices(budgets)

    monkeypatch.setattr(engine, "set_devices", recording)

    def steps():
        for k in range(CALLS):
            if k == 2:
                leave(int(devs[last] * 1.05) - engine.held_bytes_by_device.get(last, 0))
            a = sim.allocs[sim.device_index(torch.device(last), "x")]
            a.reset_peak()
            base_reserved = a.reserved
            outs.append(call(base, clone, inputs))
            peaks.append((a.max_reserved, base_reserved, engine.placement))
        return outs

    with torch.no_grad():
        sampling(clone, steps)
    assert all(torch.equal(o, ref) for o in outs)
    assert len(given) == CALLS and given[2] < given[1], given
    for k, (peak, _, _) in enumerate(peaks):   # all the engine holds there, against what was left
        assert 0 < peak <= given[k], f"call {k + 1}: {last} reserved peak {peak} B over its budget {given[k]} B"
    first, moved = peaks[1][2], peaks[2][2]
    assert moved is not first and peaks[3][2] is moved, "placed again once, then kept"
    part = next(d for d in moved.used if d.device == last) if any(d.device == last for d in moved.used) else None
    assert part is None or part.plan.peak_bytes <= given[2]
    assert "the budget fell" in engine.describe()["plan"]["refit"]["reason"]
    state.release()
    mm.unload_all_models()


def test_refusals_with_devices_name_each_device_never_max_vram_gb(simn, pack, max_vram):
    """With a Devices node the budgets are the devices' (max_vram_gb no longer sets them): the
    weights-only refusal when the node runs, and the first call's refusal and the fix it leads
    with, name each device's own smallest budget in the Devices node's form."""
    sim, fam = simn, FAMILIES["sd3_mmdit"]
    n = sim.n_devices
    with sim.host_memory():
        patcher = fam.load()
    patcher.load_device = torch.device("cuda", 0)
    inputs = fam.inputs()   # made outside host memory: cuda:0's memory
    (tiny,), _ = run_node(pack, "VRAMCutDevices", devices=", ".join(f"cuda:{i}=0.0000001" for i in range(n)),
                          reserve_gb=1.0)
    with pytest.raises(ValueError) as e:
        max_vram(1.0, model=patcher, devices=tiny)
    msg = str(e.value)
    assert "max_vram_gb" not in msg, msg
    assert all(f"cuda:{i}=0.0000001" in msg for i in range(n)) and "at least cuda:0=" in msg, msg

    biggest = max(u.weight_bytes for u in pack.vramcut_core.find_units(patcher.model.diffusion_model).units)
    (few,), _ = run_node(pack, "VRAMCutDevices", devices=", ".join(f"cuda:{i}={biggest / GIB:.9f}" for i in range(n)),
                         reserve_gb=1.0)
    (clone, _, _), _ = max_vram(1.0, model=patcher, devices=few)
    with pytest.raises(ValueError) as e, torch.no_grad():
        sampling(clone, lambda: call(clone.model, clone, inputs))
    msg, err = str(e.value), e.value.__cause__
    per = ", ".join(f"{d}={pack.vramcut_core.gib_text(b)}" for d, b in err.device_budgets)
    assert msg.startswith(f"Devices: set to {per}. ") and "max_vram_gb" not in msg, msg
    pack.nodes.state.state_of(clone).release()
