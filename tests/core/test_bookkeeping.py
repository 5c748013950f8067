"""Bookkeeping per forward: what a forward costs beyond the model's own work.

All resident in a session: the weights stay swapped in between forwards, so a forward enters no
unit, swaps no pointer and runs no hook but the module's own guard; the module is whole again
when the session ends, after an error or an interrupt, when the host says it writes weights,
and before any forward that is not ours. Streamed: one hook call per unit entered (the unit's
root), unless a measuring forward saw the unit's modules run outside its root."""
import gc

import pytest
import torch
from torch import nn

from test_executor import budget_for, ids
from toys import Boom, ExplodingStack, FluxLike, MLPBlock, TransformerStack, UNetLike, assert_unchanged, seeded, snapshot
from vramcut_core import Engine, EngineConfig

HUGE = 1 << 40  # everything resident


class Counts:
    """Counts unit entries, pointer swaps and plan set-ups of one executor (instance attributes
    shadow the methods its hooks and helpers call)."""

    def __init__(self, ex) -> None:
        self.enter = self.swap_in = self.swap_out = self.begin = 0
        for owner, attr in ((ex, "_enter"), (ex.binding, "swap_in"), (ex.binding, "swap_out"), (ex, "_begin")):
            orig = getattr(owner, attr)
            key = attr.strip("_")

            def wrapped(*a, _orig=orig, _key=key, **k):
                setattr(self, _key, getattr(self, _key) + 1)
                return _orig(*a, **k)

            setattr(owner, attr, wrapped)

    def reset(self) -> None:
        self.enter = self.swap_in = self.swap_out = self.begin = 0

    @property
    def total(self) -> int:
        return self.enter + self.swap_in + self.swap_out + self.begin


def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def flux_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, 16, generator=g), torch.rand(2, generator=g)


def test_all_resident_forward_runs_no_hooks_and_no_swaps():
    model = seeded(FluxLike())
    args = flux_inputs()
    with torch.no_grad():
        ref = model(*args)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        ex = eng.executor
        n = Counts(ex)
        with eng.session():
            first = [eng.run(model, *args) for _ in range(2)]  # measured, then the first held
            assert eng.last_plan.slots == 0 and ex.holds_weights
            n.reset()
            outs = [eng.run(model, *args) for _ in range(4)]
            assert n.total == 0, f"a held forward entered units or swapped pointers: {vars(n)}"
            assert hooks_on(model) == 1, "only the module's own guard may stay hooked"
        for o in first + outs:
            assert torch.equal(o, ref)
        assert not ex.holds_weights and ex.device_bytes == 0
        assert hooks_on(model) == 0
        assert_unchanged(model, snap)


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_held_weights_restored_after_exception_or_interrupt(exc):
    model = seeded(ExplodingStack(at=3))
    x = ids()
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            assert eng.executor.holds_weights
            if exc is KeyboardInterrupt:
                def boom(*_):
                    raise KeyboardInterrupt
                h = model.blocks[3].fc2.register_forward_hook(boom)
            else:
                model.armed = True
            with pytest.raises(exc):
                eng.run(model, x)
            if exc is KeyboardInterrupt:
                h.remove()
            model.armed = False
            assert not eng.executor.holds_weights and eng.executor.device_bytes == 0
            assert_unchanged(model, snap)
            assert hooks_on(model) == 0
            assert torch.equal(eng.run(model, x), ref)
            assert torch.equal(eng.run(model, x), ref)
        assert_unchanged(model, snap)


def _bump_device_copies(unit):
    """An on_loaded hook that changes the device copy only (as a LoRA merged on the device does)."""
    for ut in unit.tensors:
        live = ut.refs[0].get()
        if live.dtype.is_floating_point and live.dim() == 2:
            live.data.add_(0.5)


def test_a_forward_that_is_not_ours_reads_the_masters():
    model = seeded(TransformerStack())
    x = ids()
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        with eng.session():
            eng.run(model, x, on_loaded=_bump_device_copies)
            patched = eng.run(model, x, on_loaded=_bump_device_copies)
            assert not torch.equal(patched, ref), "the device copies must differ from the masters"
            assert eng.executor.holds_weights
            assert torch.equal(model(x), ref), "a plain forward between ours read the device copies"
            assert not eng.executor.holds_weights
            assert_unchanged(model, snap)
            # swapped in again, still patched once
            assert torch.equal(eng.run(model, x, on_loaded=_bump_device_copies), patched)
            assert eng.executor.holds_weights
        assert_unchanged(model, snap)


def test_weights_changed_points_back_at_the_masters_before_the_host_writes():
    model = seeded(TransformerStack())
    x = ids()
    with torch.no_grad():
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            assert eng.executor.holds_weights
            eng.weights_changed()
            assert not eng.executor.holds_weights
            model.blocks[2].fc1.weight.mul_(2)  # the host writes into its weight in place
            snap = snapshot(model)
            ref = model(x)
            assert torch.equal(eng.run(model, x), ref)
            assert torch.equal(eng.run(model, x), ref)
        assert_unchanged(model, snap)


def test_kept_buffers_hold_weights_only_when_asked():
    model = seeded(TransformerStack())
    x = ids()
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        eng.keep_buffers(True)
        for _ in range(3):
            assert torch.equal(eng.run(model, x), ref)
            assert not eng.executor.holds_weights
            assert_unchanged(model, snap)  # a host's kept buffers: the model is whole between calls
        assert eng.executor.device_bytes > 0
        eng.hold_weights(True)
        eng.run(model, x)
        assert eng.executor.holds_weights
        eng.hold_weights(False)
        assert not eng.executor.holds_weights
        assert_unchanged(model, snap)
        eng.hold_weights(True)
        eng.run(model, x)
        eng.keep_buffers(False)
        assert not eng.executor.holds_weights and eng.executor.device_bytes == 0
        assert_unchanged(model, snap)


def test_a_session_ending_with_buffers_kept_gives_the_weights_back():
    model = seeded(TransformerStack())
    x = ids()
    with torch.no_grad():
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        eng.keep_buffers(True)
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            assert eng.executor.holds_weights
        assert not eng.executor.holds_weights and eng.executor.device_bytes > 0
        assert_unchanged(model, snap)
        eng.keep_buffers(False)


def test_an_executor_dropped_while_holding_restores_the_module():
    model = seeded(TransformerStack())
    x = ids()
    with torch.no_grad():
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        eng.keep_buffers(True)
        eng.hold_weights(True)
        eng.run(model, x)
        eng.run(model, x)
        assert eng.executor.holds_weights
        del eng
        gc.collect()
        assert_unchanged(model, snap)
        assert hooks_on(model) == 0


def test_a_new_plan_gives_the_held_weights_back_first():
    model = seeded(TransformerStack())
    small, big = ids(n=8), ids(b=3, n=20)
    with torch.no_grad():
        ref_small, ref_big = model(small), model(big)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        with eng.session():
            eng.run(model, small)
            eng.run(model, small)
            held = eng.executor.binding.held
            assert held is not None
            assert torch.equal(eng.run(model, big), ref_big)  # measured with the weights given back
            assert torch.equal(eng.run(model, big), ref_big)
            assert eng.executor.binding.held is not held
            assert torch.equal(eng.run(model, small), ref_small)
        assert_unchanged(model, snap)


def test_streamed_forward_hooks_each_unit_it_enters_once():
    model = seeded(TransformerStack(d=32, depth=8))
    x = ids()
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model), device="cpu"))
        ex = eng.executor
        n = Counts(ex)
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            plan = eng.last_plan
            streamed = plan.streamed_order
            assert streamed and plan.resident_units, "the budget should stream some units, keep others"
            assert all(ex.hooks.contained[u] for u in streamed)
            # and each resident unit that ends a streamed group (its entry frees that group's slot)
            ends = [u for u in plan.resident_units if u in ex.walk.schedule.frees]
            assert all(ex.hooks.contained[u] for u in ends)
            roots = sum(len(eng.planner.all[u].roots) for u in (*streamed, *ends))
            assert hooks_on(model) == roots, "one hook per root of each streamed unit and group end, none elsewhere"
            for _ in range(3):
                n.reset()
                assert torch.equal(eng.run(model, x), ref)
                assert n.enter == len(streamed) + len(ends), f"{n.enter} unit entries for {len(streamed)} streamed units"
        assert_unchanged(model, snap)


class PeekStack(TransformerStack):
    """Runs a module of block 2 before the blocks, outside block 2's own call."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.blocks[2].norm(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm_out(x))


def test_a_unit_whose_modules_run_outside_its_root_keeps_every_hook():
    model = seeded(PeekStack(d=32, depth=8))
    x = ids()
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model), device="cpu", residency=False))
        ex = eng.executor
        with eng.session():
            outs = [eng.run(model, x) for _ in range(4)]
            assert ex.hooks.contained["blocks.2"] is False
            assert ex.hooks.contained["blocks.3"] is True
            peek = eng.planner.all["blocks.2"]
            assert all(len(m._forward_pre_hooks) == 1 for m in peek.hook_modules)
            assert len(model.blocks[3].norm._forward_pre_hooks) == 0
        for o in outs:
            assert torch.equal(o, ref)
        assert_unchanged(model, snap)


def test_unet_children_called_directly_keep_hooks_on_their_modules():
    model = seeded(UNetLike())
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, generator=g))
    with torch.no_grad():
        ref = model(*args)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model, *args), device="cpu", residency=False))
        with eng.session():
            outs = [eng.run(model, *args) for _ in range(3)]
            blocks = [u for u in eng.last_plan.streamed_order if u.startswith(("input_blocks.", "output_blocks."))]
            assert blocks and not any(eng.executor.hooks.contained[u] for u in blocks)
        for o in outs:
            assert torch.equal(o, ref)
        assert_unchanged(model, snap)


# -- the CUDA branch on the simulated accelerator ------------------------------------------------

from test_sim_cuda import assert_restored, cuda_engine, sim, values  # noqa: E402,F401  (sim: fixture)


@pytest.mark.parametrize("fail", [False, True], ids=["held", "error-while-held"])
def test_cuda_held_weights_stay_on_the_device_between_forwards_without_hazards(sim, fail):
    with sim.host_memory(), torch.no_grad():
        model = seeded(ExplodingStack(at=3))
        x = ids()
        ref = model(x)
        snap = values(model)
    with torch.no_grad():
        eng = cuda_engine(model, HUGE)
        n = Counts(eng.executor)
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            assert eng.executor.holds_weights
            assert all(sim.is_device(p) for p in model.parameters()), "held weights live on the device"
            n.reset()
            outs = [eng.run(model, x) for _ in range(3)]
            assert n.total == 0
            if fail:
                model.armed = True
                with pytest.raises(Boom):
                    eng.run(model, x)
                model.armed = False
                assert_restored(model, snap, sim)
                outs.append(eng.run(model, x))
        for o in outs:
            assert torch.equal(o, ref)
        assert eng.executor.device_bytes == 0
    assert_restored(model, snap, sim)


def test_buffers_views_follow_the_grad_mode_of_each_forward():
    """Views of the executor's buffers are made once, but one made in inference mode is never
    used for a copy in a forward outside it (where in-place writes to it are refused)."""
    model = seeded(TransformerStack(d=32, depth=8))
    x = ids()
    with torch.no_grad():
        ref = model(x)
        budget = budget_for(model)
    eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu"))
    with eng.session():
        with torch.no_grad():
            eng.run(model, x)
            eng.run(model, x)
        with torch.inference_mode():
            assert torch.equal(eng.run(model, x), ref)
        with torch.no_grad():
            assert torch.equal(eng.run(model, x), ref)


def test_out_of_memory_in_a_held_forward_says_where_it_can():
    """Resident units are not tracked outside measuring forwards: the error says so instead of
    claiming that no unit ran."""
    model = seeded(ExplodingStack(at=3))
    x = ids()
    with torch.no_grad():
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=HUGE, device="cpu"))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            assert eng.executor.holds_weights

            def oom(*_):
                raise torch.OutOfMemoryError("out of memory (raised by the test)")

            h = model.blocks[3].fc2.register_forward_hook(oom)
            with pytest.raises(torch.OutOfMemoryError, match="in a resident segment"):
                eng.run(model, x)
            h.remove()
            assert_unchanged(model, snap)


def test_a_call_counts_the_copies_it_reads_not_those_it_made_for_a_next_call():
    """The schedule copies the next call's first groups while a call ends (two slots, in a
    session). Those copies count in the call that reads them: every steady call, in a session of
    one call (a VAE decode) or of many (sampling), streams what its plan says per call, and a
    session's last copies for a call that never comes count nowhere."""
    model = seeded(TransformerStack(d=32, depth=8))
    x = ids()
    budget = budget_for(model, x, share=0.3)
    eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu"))
    with torch.no_grad():
        with eng.session():
            eng.run(model, x)            # the measuring call
        plan = eng.last_plan
        assert plan.slots == 2 and len(plan.streamed_groups) >= 3, "the case needs the wrap-around"
        per_call = []
        for calls in (1, 1, 3):
            with eng.session():
                for _ in range(calls):
                    eng.run(model, x)
                    per_call.append((eng.last_stats.copies, eng.last_stats.bytes_streamed))
    assert eng.last_plan is plan
    assert per_call == [(plan.transfers_per_forward, plan.streamed_bytes_per_forward)] * 5, per_call
