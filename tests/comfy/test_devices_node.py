"""The Devices node and the budget that follows free VRAM, on the node side: the devices text
checked against what the host can see before anything moves, a workflow without the Devices node
exactly as before, ComfyUI's MultiGPU CFG Split refused beside devices, ComfyUI's model size the
home device's budget, free VRAM read again before every call, and the node's time line, per-device
answer and re-plan notice built from the plan's JSON (the contract's keys)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tiny_models as tm
from pack_nodes import run_node

GIB = 1 << 30


@pytest.fixture
def host_with_two_gpus(pack, monkeypatch):
    """A CPU host that counts two CUDA devices (nothing runs on them: only the check that names
    them reads the count)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    import comfy.model_management as mm

    total = mm.get_total_memory  # the two GPUs' total memory (the Devices node checks the reserve against it)
    monkeypatch.setattr(mm, "get_total_memory", lambda dev=None, torch_total_too=False: (
        24 * GIB if torch.device(dev).type == "cuda" else total(dev, torch_total_too)))


def devices(pack, text, reserve_gb=1.0):
    return pack.nodes.devices.Devices(text, reserve_gb)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("cpu", "is not DEVICE=GIB"),
    ("gpu0=4", "unknown device 'gpu0'"),
    ("cpu=-1", "positive number of GiB"),
    ("cpu=lots", "positive number of GiB"),
    ("cpu=4, cpu=2", "named twice"),
    ("cpu=4, cuda:2=4", "cuda:2 is not a device this host can see"),
    ("cuda:0=4, cuda:1=free", "the host's main device cpu is not in the list"),
])
def test_bad_devices_are_refused_on_both_nodes_before_anything_moves(pack, max_vram, host_with_two_gpus, text, message):
    """Each bad entry gets its own message, on the Devices node and on the Max VRAM node, and the
    model connected is left as it was (no engine made, the host's model unchanged)."""
    model = tm.load_tiny_sd3(depth=2, seed=3)
    before = {n: p.detach().clone() for n, p in model.model.diffusion_model.named_parameters()}
    _, ui = run_node(pack, "VRAMCutDevices", devices=text, reserve_gb=1.0)
    assert message in ui["vramcut"][0]["message"], ui
    with pytest.raises(ValueError, match=message):
        max_vram(1.0, model=model, devices=devices(pack, text))
    for n, p in model.model.diffusion_model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p.detach(), before[n]), n
    assert model.attachments.get("vramcut") is None


def test_a_negative_reserve_is_refused(pack):
    _, ui = run_node(pack, "VRAMCutDevices", devices="cpu=free", reserve_gb=-1.0)
    assert "reserve_gb must be a number of GiB, not negative" in ui["vramcut"][0]["message"]


def test_a_reserve_larger_than_the_device_is_refused_before_any_model_loads(pack):
    """Said by the Devices node itself (it runs before the Max VRAM node, which waits for the
    checkpoint), in three decimals, naming the CPU's memory as memory."""
    import comfy.model_management as mm

    total = mm.get_total_memory(torch.device("cpu")) / GIB
    _, ui = run_node(pack, "VRAMCutDevices", devices="cpu=free", reserve_gb=round(total + 1, 4))
    assert f"reserve_gb {round(total + 1, 4):.3f} GiB is not less than cpu's total memory" in ui["vramcut"][0]["message"]
    _, ui = run_node(pack, "VRAMCutDevices", devices="cpu=free", reserve_gb=0.5)
    assert ui["vramcut"][0]["message"] is None


def test_a_budget_alone_is_the_main_devices_and_the_default_is_this_hosts(pack):
    (out,), ui = run_node(pack, "VRAMCutDevices", devices="free", reserve_gb=0.5)
    assert ui["vramcut"][0]["message"] is None and out.entries() == [("cpu", None)]
    (out,), _ = run_node(pack, "VRAMCutDevices", devices=" 2.5 ", reserve_gb=0.5)
    assert out.entries() == [("cpu", int(2.5 * GIB))]
    assert pack.nodes.devices.default_text() == "cpu=free"
    schema = pack.nodes.max_vram.VRAMCutDevices.define_schema()
    assert schema.inputs[0].default == "cpu=free"


def test_the_devices_node_gives_the_devices_as_typed(pack, host_with_two_gpus):
    (out,), _ = run_node(pack, "VRAMCutDevices", devices="cpu=2, cuda:1=free", reserve_gb=0.5)
    assert out.entries() == [("cpu", 2 * GIB), ("cuda:1", None)]
    assert out.to_json() == [{"device": "cpu", "budget_bytes": 2 * GIB}, {"device": "cuda:1", "budget_bytes": None}]


def test_free_budgets_are_free_memory_less_the_reserve(pack, monkeypatch):
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (5 * GIB, 5 * GIB) if torch_free_too else 5 * GIB)
    d = devices(pack, "cpu=free", reserve_gb=1.0)
    assert d.budgets("cpu") == (("cpu", 4 * GIB),)
    # on the home device the host's own answer (what it could free) wins
    assert d.budgets("cpu", free_memory=lambda dev: 9 * GIB) == (("cpu", 8 * GIB),)
    with pytest.raises(ValueError, match="leaves no budget"):
        devices(pack, "cpu=free", reserve_gb=6.0).budgets("cpu")


# ---------------------------------------------------------------- no devices: as before


def test_without_devices_the_node_is_todays(pack, max_vram):
    """No Devices node: the engine's configuration is the one a Max VRAM node built before the
    input existed (one budget, one device, no ``devices``), the payload has no devices, the plan
    is the same with the input left unconnected or absent, and sampling is bit-equal to the
    unpatched model's."""
    Engine, EngineConfig = pack.vramcut_core.Engine, pack.vramcut_core.EngineConfig

    model = tm.load_tiny_sd3(depth=4, seed=1)
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, (1, 16, 8, 8), steps=2)
    (patched, _, _), payload = max_vram(0.02, model=model)
    (again, _, _), payload2 = max_vram(0.02, model=model, devices=None)
    assert "devices" not in payload and "devices" not in payload2
    state = pack.nodes.patcher.state_of(patched)
    (engine,) = state.engines()
    old = EngineConfig(budget_bytes=int(0.02 * GIB), device=str(patched.load_device), prefetch=True, residency=True,
                       keep_resident=(), pin_memory=engine.config.pin_memory,
                       keep_file_backed=engine.config.keep_file_backed)
    assert engine.config == old
    assert all(not v for k, v in dataclasses.asdict(engine.config).items() if k == "devices")
    without_cost = lambda p: {k: v for k, v in p["models"][0]["plan"].items() if k != "cost"}  # noqa: E731
    assert without_cost(payload) == without_cost(payload2)  # (the cost's bandwidth is measured anew)
    by_hand = Engine(model.model.diffusion_model, old).describe(None)["plan"]
    assert payload["models"][0]["plan"]["segments"] == by_hand["segments"]
    assert torch.equal(tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=2), ref)
    assert torch.equal(tm.sample(again, pos, neg, (1, 16, 8, 8), steps=2), ref)


# ---------------------------------------------------------------------- with devices


def test_devices_reach_the_engine_or_are_refused_clearly(pack, max_vram):
    """With the Devices node the engine is built with each device's budget (the home device the
    host's, the budget their sum); an engine that plans one device only is named in the error
    (the node never passes devices the user did not give)."""
    EngineConfig = pack.vramcut_core.EngineConfig

    model = tm.load_tiny_sd3(depth=2, seed=2)
    if "devices" not in EngineConfig.__dataclass_fields__:
        with pytest.raises(ValueError, match="plans one device only"):
            max_vram(1.0, model=model, devices=devices(pack, "cpu=0.5"))
        return
    (patched, _, _), payload = max_vram(1.0, model=model, devices=devices(pack, "cpu=0.5"))
    assert payload["devices"] == [{"device": "cpu", "budget_bytes": GIB // 2}]
    (engine,) = pack.nodes.patcher.state_of(patched).engines()
    assert tuple(engine.config.devices) == (("cpu", GIB // 2),) and engine.config.device == "cpu"
    assert engine.config.budget_bytes == GIB // 2
    pos, neg = tm.tiny_sd3_conditioning()
    assert torch.equal(tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=1),
                       tm.sample(model, pos, neg, (1, 16, 8, 8), steps=1))


def test_model_size_is_the_home_devices_budget(pack):
    """What ComfyUI frees on the load device before loading: that device's budget (with devices,
    its entry; a free entry or free mode: the model's size, as before)."""
    Settings = pack.nodes.state.Settings
    assert Settings(6.0).home_budget_bytes("cpu") == 6 * GIB
    assert Settings(6.0, "free VRAM minus reserve").home_budget_bytes("cpu") is None
    assert Settings(6.0, devices=devices(pack, "cpu=2")).home_budget_bytes("cpu") == 2 * GIB
    assert Settings(6.0, devices=devices(pack, "cpu=free")).home_budget_bytes("cpu") is None


def test_model_size_follows_the_budget_on_the_patched_model(pack, max_vram):
    model = tm.load_tiny_sd3(depth=2, seed=2)
    (patched, _, _), _ = max_vram(0.001, model=model)
    assert patched.model_size() == int(0.001 * GIB) < model.model_size()


# -------------------------------------------------------------- ComfyUI's MultiGPU CFG split


def _cfg_split(model):
    """The model as ComfyUI's MultiGPU CFG Split leaves it: a copy for each extra GPU among its
    additional models (here one clone standing for the copy on a second GPU)."""
    if not hasattr(model, "set_additional_models"):
        pytest.skip("this host has no additional models (no MultiGPU CFG Split)")
    split = model.clone()
    split.set_additional_models("multigpu", [model.clone()])
    return split


def test_cfg_split_beside_devices_is_refused_with_a_clear_message(pack, max_vram):
    model = tm.load_tiny_sd3(depth=2, seed=4)
    with pytest.raises(ValueError, match="MultiGPU CFG Split"):
        max_vram(1.0, model=_cfg_split(model), devices=devices(pack, "cpu=1"))
    # without devices the split model is patched as before (each copy under the budget)
    (patched, _, _), _ = max_vram(1.0, model=_cfg_split(model))
    assert pack.nodes.patcher.state_of(patched) is not None


def test_cfg_split_added_after_the_node_is_refused_before_sampling_loads(pack):
    """The CFG Split node placed after the Max VRAM node: the sampling run is refused in its
    outer wrapper, before the host loads anything, and the node says why."""
    st = pack.nodes.state
    report = pack.nodes.report.NodeReport(None, st.Settings(1.0, devices=devices(pack, "cpu=1")))
    state = st.PatchState("MODEL", report=report, settings=st.Settings(1.0, devices=devices(pack, "cpu=1")))
    wrapper = pack.nodes.patching._OuterSampleWrapper(state)
    model = tm.load_tiny_sd3(depth=2, seed=4)

    class Executor:
        class_obj = type("Guider", (), {"model_patcher": _cfg_split(model)})()
        ran = False

        def __call__(self, *a, **k):
            self.ran = True

    ex = Executor()
    with pytest.raises(ValueError, match="MultiGPU CFG Split"):
        wrapper(ex)
    assert not ex.ran and "MultiGPU CFG Split" in report.payload["message"]
    # a model not split runs through
    ex.class_obj = type("Guider", (), {"model_patcher": model})()
    wrapper(ex)
    assert ex.ran


# ------------------------------------------------------------------- free VRAM, every call


def test_free_vram_is_read_again_before_each_call(pack, max_vram, monkeypatch):
    """'free VRAM minus reserve': before each call the node reads free memory again (plus what
    the engine holds itself) and hands the engine the new budget; when another program takes
    memory between steps, the next call's budget is smaller. The engine decides whether to plan
    again; the output stays the unpatched model's."""
    import comfy.model_management as mm

    free = [3 * GIB]
    monkeypatch.setattr(mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (free[0], free[0]) if torch_free_too else free[0])
    model = tm.load_tiny_sd3(depth=2, seed=6)
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, (1, 16, 8, 8), steps=3)
    (patched, _, _), _ = max_vram(1024.0, model=model, budget_mode="free VRAM minus reserve", reserve_gb=1.0)
    (engine,) = pack.nodes.patcher.state_of(patched).engines()
    given = []
    set_budget = engine.set_budget

    def recording(budget):
        given.append((budget, free[0], engine.held_bytes))
        free[0] -= GIB // 2  # another program takes memory before the next call
        return set_budget(budget)

    monkeypatch.setattr(engine, "set_budget", recording)
    out = tm.sample(patched, pos, neg, (1, 16, 8, 8), steps=3)
    assert torch.equal(out, ref)
    assert len(given) >= 3, given
    for budget, free_then, held in given:
        assert budget == free_then + held - GIB, (budget, free_then, held)
    assert given[-1][0] < given[0][0]


# ------------------------------------------------------------- the node's lines from the plan


def test_time_answer_from_the_plans_time(pack):
    time_answer = pack.nodes.report.time_answer

    assert time_answer(None) is None
    assert time_answer({"predicted_s": 1.0}) is None
    before = time_answer({"predicted_s": 1.5, "resident_s": 1.0, "source": "flops", "measured_s": None, "error": None})
    assert before == {"predicted_s": 1.5, "resident_s": 1.0, "added_s": 0.5, "ratio": 1.5, "source": "flops",
                      "measured_s": None, "error": None}
    after = time_answer({"predicted_s": 1.5, "resident_s": 1.0, "source": "measured", "measured_s": 2.0, "error": -0.25})
    assert after["measured_s"] == 2.0 and after["error"] == -0.25


def contract_plan(plan: dict) -> dict:
    """``plan`` with the keys the engine branches add (the contract's shapes), two devices."""
    half = max(1, len(plan["segments"]) // 2)
    seg = plan["segments"]
    return dict(
        plan,
        devices=[
            {"device": "cuda:0", "budget_bytes": 10 * GIB, "peak_bytes": 9 * GIB, "resident_bytes": 7 * GIB,
             "window_bytes": GIB, "activation_bytes": GIB, "streamed_bytes_per_call": 2 * GIB, "copies_per_call": 2,
             "measured_peak_bytes": None, "segments": seg[:half]},
            {"device": "cuda:1", "budget_bytes": 6 * GIB, "peak_bytes": 7 * GIB, "resident_bytes": 5 * GIB,
             "window_bytes": GIB, "activation_bytes": GIB, "streamed_bytes_per_call": 0, "copies_per_call": 0,
             "measured_peak_bytes": None, "segments": seg[half:]}],
        hops=[{"src": "cuda:0", "dst": "cuda:1", "unit": seg[half]["units"][0] if len(seg) > half else "final",
               "bytes": 3 << 20}],
        hop_bytes_per_call=3 << 20, hops_per_call=1,
        time={"predicted_s": 1.2, "resident_s": 1.0, "source": "flops", "measured_s": None, "error": None},
        refit={"reason": "free VRAM fell", "budget_bytes": 5 * GIB, "previous_budget_bytes": 8 * GIB})


def test_the_node_carries_per_device_answer_time_and_replan_from_the_plan(pack, max_vram, monkeypatch):
    """With the contract's keys in the plan JSON, the node's entry says: over budget when one
    device is (cuda:1 here, though the sum fits), the hops per call, the time line's figures, and
    the re-plan; without them it is as before."""
    model = tm.load_tiny_sd3(depth=4, seed=1)
    (patched, _, _), payload = max_vram(0.02, model=model)
    entry = payload["models"][0]
    assert "time" not in entry and "refit" not in entry and "devices" not in entry["plan"]["cost"]
    (engine,) = pack.nodes.patcher.state_of(patched).engines()
    describe = engine.describe
    monkeypatch.setattr(engine, "describe", lambda plan=None: dict(d := describe(plan), plan=contract_plan(d["plan"])))
    report = pack.nodes.report.NodeReport(None, pack.nodes.state.Settings(0.02))
    report.set("MODEL", engine)
    entry = report.payload["models"][0]
    cost = entry["plan"]["cost"]
    assert cost["fits"] is False and cost["devices"] == 2 and cost["hops_per_call"] == 1
    assert cost["hop_bytes_per_call"] == 3 << 20
    assert entry["time"]["added_s"] == pytest.approx(0.2) and entry["time"]["ratio"] == pytest.approx(1.2)
    assert entry["refit"]["budget_bytes"] == 5 * GIB
