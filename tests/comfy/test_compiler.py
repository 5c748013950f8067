"""The host's model compiler (ComfyUI 0.38's recorded allocation graphs) is off while VRAMCut runs
a model, and put back after.

On the simulated accelerator, with a stand-in for the compiler shaped like 0.38's
(``tests/compiler_host.py``) and a model whose forward opens a recording around its blocks as
Qwen-Image 2.1's does: sampled through the pack's own wrappers, no unit of a patched model runs,
and nothing is allocated, while a recording is on; the measured peaks are the ones measured with
no compiler at all; the host's switch is as it was after the run. ``test_sim_catches_*`` takes
the switch-off out and shows the stand-in sees the forward inside the recording.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from compiler_host import CompilerStandIn, Qwen21Shaped, sample_through_wrappers

GIB = 1 << 30
STEPS = 3


@pytest.fixture
def stand_in(sim, monkeypatch, link_figure):
    return CompilerStandIn(monkeypatch, sim)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 32, 16, generator=g), torch.rand(2, generator=g)


def _model(stand_in, sim):
    with sim.host_memory():
        torch.manual_seed(0)
        return Qwen21Shaped(stand_in=stand_in)


def _budget(model, x, t, pack, stand_in):
    """About half the weights streamed, the activations measured first (compiler off)."""
    Engine, EngineConfig, find_units = (getattr(pack.vramcut_core, n) for n in ("Engine", "EngineConfig", "find_units"))
    with pack.nodes.compiler.compiler_off():
        probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cuda"))
        probe.run(model, x, t)
        probe.release()
    us = find_units(model)
    biggest = max(u.weight_bytes for u in us.units)
    return max(int(us.weight_bytes * 0.45), 3 * biggest) + probe.last_plan.activation_reserve_bytes


def _sample(pack, model, x, t, budget):
    outs, peaks, meas, _ = sample_through_wrappers(pack, model, x, t, budget, STEPS)
    return outs, peaks, meas


def _reference(model, x, t, pack):
    with torch.no_grad(), pack.nodes.compiler.compiler_off():
        return model(x, t)


def test_models_vramcut_runs_never_execute_inside_a_recording(sim, stand_in, pack, monkeypatch):
    from comfy.cli_args import args

    x, t = _inputs()
    model = _model(stand_in, sim)
    ref = _reference(model, x, t, pack)
    budget = _budget(model, x, t, pack, stand_in)
    with torch.no_grad():   # the stand-in records the host's own forward: it is not blind
        model(x, t)
    assert stand_in.blocks_recorded and stand_in.allocations
    stand_in.blocks_recorded.clear()
    stand_in.allocations.clear()
    stand_in.begun = 0

    outs, peaks, meas = _sample(pack, model, x, t, budget)
    assert all(torch.equal(o, ref) for o in outs)
    assert stand_in.begun == 0, "a recording began while VRAMCut ran the model"
    assert not stand_in.blocks_recorded and not stand_in.allocations
    assert args.disable_comfy_compiler is False, "the host's switch is put back after the run"

    # the same run on a host without the compiler: the same measured peaks, step by step
    monkeypatch.delattr(args, "disable_comfy_compiler")
    plain = _model(stand_in, sim)
    outs_plain, peaks_plain, meas_plain = _sample(pack, plain, x, t, budget)
    assert all(torch.equal(o, ref) for o in outs_plain)
    assert peaks == peaks_plain and meas == meas_plain
    assert max(peaks) <= budget


def test_the_switch_is_put_back_when_sampling_fails(sim, stand_in, pack, monkeypatch):
    from comfy.cli_args import args

    x, t = _inputs()
    model = _model(stand_in, sim)
    budget = _budget(model, x, t, pack, stand_in)
    seen = []

    def boom(module, _args):
        seen.append(args.disable_comfy_compiler)
        raise RuntimeError("interrupted")

    h = model.transformer_blocks[2].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            _sample(pack, model, x, t, budget)
    finally:
        h.remove()
    assert seen and all(seen) and args.disable_comfy_compiler is False


def test_sim_catches_a_forward_inside_a_recording(sim, stand_in, pack, monkeypatch):
    """Without the switch-off, the patched model's blocks run inside the recording, allocate
    into it, and the measured peak is the recording's, not the allocator's."""
    for mod in (pack.nodes.state, pack.nodes.patching):
        monkeypatch.setattr(mod, "compiler_off", contextlib.nullcontext)
    x, t = _inputs()
    model = _model(stand_in, sim)
    budget = _budget(model, x, t, pack, stand_in) * 4  # room for what the recording keeps
    _, peaks, _ = _sample(pack, model, x, t, budget)
    assert stand_in.begun >= STEPS and stand_in.blocks_recorded and stand_in.allocations

    from comfy.cli_args import args
    monkeypatch.delattr(args, "disable_comfy_compiler")
    _, peaks_plain, _ = _sample(pack, _model(stand_in, sim), x, t, budget)
    assert peaks != peaks_plain and max(peaks) > max(peaks_plain)


# -- the switch itself --------------------------------------------------------------------------

@pytest.fixture
def switch(comfy, pack, monkeypatch):
    from comfy.cli_args import args
    monkeypatch.setattr(args, "disable_comfy_compiler", False, raising=False)
    return args, pack.nodes.compiler.compiler_off


def test_nested_and_overlapping_holds_put_the_switch_back_once(switch):
    args, off = switch
    outer = off()
    outer.__enter__()
    with off():
        assert args.disable_comfy_compiler is True
    assert args.disable_comfy_compiler is True, "an inner hold must not end the outer one"
    outer.__exit__(None, None, None)
    assert args.disable_comfy_compiler is False


def test_a_users_disable_comfy_compiler_is_left_as_it_is(switch):
    args, off = switch
    args.disable_comfy_compiler = True
    with off():
        pass
    assert args.disable_comfy_compiler is True


def test_hosts_without_the_compiler_get_no_switch(comfy, pack, monkeypatch):
    from comfy.cli_args import args
    if hasattr(args, "disable_comfy_compiler"):
        monkeypatch.delattr(args, "disable_comfy_compiler")
    with pack.nodes.compiler.compiler_off():
        assert not hasattr(args, "disable_comfy_compiler")
    assert not hasattr(args, "disable_comfy_compiler")
