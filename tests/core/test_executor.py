import pytest
import torch
from torch import nn

from toys import (Boom, BufferedStack, ExplodingStack, FluxLike, MixedDtypeStack, QuantStack, TiedStack,
                  TransformerStack, UNetLike, assert_unchanged, seeded, snapshot)
from vramcut_core import BudgetError, Engine, EngineConfig, find_units
from vramcut_core.model.tensors import tensor_nbytes
from unit_checks import assert_peak_within_budget


def ids(b=2, n=12, vocab=50, seed=0):
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def cases():
    g = torch.Generator().manual_seed(1)
    return [
        ("transformer", lambda: seeded(TransformerStack()), lambda: (ids(),)),
        ("unet_skips", lambda: seeded(UNetLike()), lambda: (torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, generator=g))),
        ("flux_root_param", lambda: seeded(FluxLike()), lambda: (torch.randn(2, 5, 16, generator=g), torch.rand(2, generator=g))),
        ("tied_weights", lambda: seeded(TiedStack()), lambda: (ids(),)),
        ("buffers", lambda: seeded(BufferedStack()), lambda: (torch.randn(6, 8, generator=g),)),
        ("fp8_bf16_fp16", lambda: MixedDtypeStack().eval(), lambda: (torch.randn(3, 32, generator=g),)),
        ("tensor_subclass", lambda: QuantStack().eval(), lambda: (torch.randn(3, 16, generator=g),)),
    ]


def budget_for(model, *args, share=0.45):
    """A budget below the model's weights, with room for the window (two slots of the largest
    unit) and the activations a measured forward of ``args`` sees."""
    us = find_units(model)
    biggest = max(u.weight_bytes for u in us.units if not u.keep_resident)
    pinned = sum(u.weight_bytes for u in us.units if u.keep_resident)
    act = _probe_plan(model, *(args or (ids(),))).activation_reserve_bytes
    return max(int(us.weight_bytes * share) + act, pinned + 2 * biggest + biggest // 2 + act)


def _probe_plan(model, *args):
    """The measured plan of one forward of ``args`` at a budget that holds everything."""
    probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
    with torch.no_grad():
        probe.run(model, *args)
    return probe.last_plan


@pytest.mark.parametrize("name,build,inputs", cases(), ids=[c[0] for c in cases()])
def test_segmented_forward_is_bit_exact_within_budget_and_restores(name, build, inputs):
    model = build()
    args = inputs()
    with torch.no_grad():
        ref = model(*args)
        snap = snapshot(model)
        budget = budget_for(model, *args)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", track_cpu_memory=True))
        outs = []
        with eng.session():
            for _ in range(3):
                outs.append(eng.run(model, *args))
                assert_unchanged(model, snap)  # between forwards too, buffers held or not
        for o in outs:
            assert torch.equal(o, ref), f"{name}: segmented output differs"
        assert_unchanged(model, snap)
        plan = eng.last_plan
        assert plan.measured and plan.peak_bytes <= budget
        assert plan.streamed_bytes_per_forward > 0, "the budget should force streaming"
        assert eng.stats.peak_weight_bytes <= plan.resident_bytes + plan.window_bytes + _subclass_bytes(model)
        assert_peak_within_budget(eng.stats, budget)  # every forward, the first (measuring) one included
        assert eng.executor.device_bytes == 0, "device buffers must be released after the session"


def _subclass_bytes(model):
    return sum(tensor_nbytes(p) for p in model.parameters() if type(p) not in (torch.Tensor, nn.Parameter))


def test_prefetch_streams_each_unit_once_per_forward_and_reuses_resident_weights():
    model = seeded(TransformerStack(d=32, depth=8))
    x = ids()
    with torch.no_grad():
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model), device="cpu"))
        with eng.session():
            eng.run(model, x)           # measured forward
            eng.run(model, x)
            second = eng.last_stats
            eng.run(model, x)
            third = eng.last_stats
    plan = eng.last_plan
    assert plan.resident_units and plan.slots == 2
    # from the third forward on, the first streamed unit was prefetched at the end of the last one
    assert third.bytes_streamed == plan.streamed_bytes_per_forward
    assert third.sync_loads == 0
    assert second.bytes_streamed >= plan.streamed_bytes_per_forward


def test_same_signature_plans_once_new_shape_plans_again():
    model = seeded(TransformerStack())
    calls = []
    with torch.no_grad():
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model), device="cpu"),
                     on_plan=lambda e, p, s: calls.append(p))
        ref_small, ref_big = model(ids(n=8)), model(ids(b=3, n=20))
        with eng.session():
            a = eng.run(model, ids(n=8))
            p1 = eng.last_plan
            eng.run(model, ids(n=8))
            assert eng.last_plan is p1
            b = eng.run(model, ids(b=3, n=20))
            p2 = eng.last_plan
            c = eng.run(model, ids(n=8))
            assert eng.last_plan is p1
    assert len(calls) == 2 and p2 is not p1
    assert torch.equal(a, ref_small) and torch.equal(c, ref_small) and torch.equal(b, ref_big)
    big_act = max(u.peak_bytes for u in p2.units)
    assert big_act > max(u.peak_bytes for u in p1.units), "a bigger input measures bigger activations"


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_exact_restore_after_exception_mid_segment(exc):
    model = seeded(ExplodingStack(at=3))
    x = ids()
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model), device="cpu"))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            model.armed = True
            if exc is KeyboardInterrupt:
                def boom(*_):
                    raise KeyboardInterrupt
                h = model.blocks[3].fc2.register_forward_hook(boom)
                model.armed = False
            with pytest.raises(exc):
                eng.run(model, x)
            if exc is KeyboardInterrupt:
                h.remove()
            model.armed = False
            assert_unchanged(model, snap)
            for m in model.modules():
                assert not m._forward_pre_hooks, "hooks must be removed"
            again = eng.run(model, x)
        assert torch.equal(again, ref)
        assert_unchanged(model, snap)
        assert eng.executor.device_bytes == 0


class SkipRepeat(TransformerStack):
    """Skips some blocks (skip-layer guidance) and runs one block twice."""

    def __init__(self):
        super().__init__(depth=6)
        self.skip = set()

    def forward(self, ids):
        x = self.embed(ids)
        for i, b in enumerate(self.blocks):
            if i in self.skip:
                continue
            x = b(x)
            if i == 1:
                x = b(x)  # the same block again
        x = self.blocks[0](x)  # and an early block after the later ones
        return self.head(self.norm_out(x))


def test_skipped_and_repeated_blocks_find_their_weights():
    model = seeded(SkipRepeat())
    x = ids()
    with torch.no_grad():
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model, share=0.3), device="cpu"))
        with eng.session():
            assert torch.equal(eng.run(model, x), model(x))
            model.skip = {2, 4}
            out = eng.run(model, x)
            model_out = model(x)
            assert torch.equal(out, model_out)
            model.skip = set()
            assert torch.equal(eng.run(model, x), model(x))


def test_block_replace_wrappers_still_enter_the_unit():
    model = seeded(TransformerStack())
    x = ids()
    orig = model.blocks[2].forward
    model.blocks[2].forward = lambda h: orig(h) * 1.0  # a patch calling the original block
    with torch.no_grad():
        ref = model(x)
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model, share=0.3), device="cpu"))
        with eng.session():
            for _ in range(2):
                assert torch.equal(eng.run(model, x), ref)


def test_unit_that_cannot_fit_is_cut_finer():
    model = seeded(TransformerStack(d=32, depth=4))
    us = find_units(model)
    block = us.by_name["blocks.0"].weight_bytes
    x = ids()
    with torch.no_grad():
        ref = model(x)
        eng = Engine(model, EngineConfig(budget_bytes=int(block * 1.6), device="cpu"))
        with eng.session():
            out = eng.run(model, x)
            out2 = eng.run(model, x)
    assert torch.equal(out, ref) and torch.equal(out2, ref)
    assert "blocks.0" in eng.last_plan.split
    assert any(u.name.startswith("blocks.0.") for u in eng.last_plan.units)
    assert eng.last_plan.peak_bytes <= eng.config.budget_bytes


def test_budget_below_anything_is_a_clear_error_and_loses_nothing():
    model = seeded(TransformerStack(d=32, depth=4))
    snap = snapshot(model)
    eng = Engine(model, EngineConfig(budget_bytes=1024, device="cpu"))
    with pytest.raises(BudgetError, match=r"too small.*smallest max_vram_gb that works for this shape is"):
        with torch.no_grad():
            eng.run(model, ids())
    assert_unchanged(model, snap)


def test_forward_outside_a_session_releases_buffers():
    model = seeded(TransformerStack())
    x = ids()
    with torch.no_grad():
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model), device="cpu"))
        eng.run(model, x)
        assert eng.executor.device_bytes == 0
        assert torch.equal(eng.run(model, x), model(x))
        assert eng.executor.device_bytes == 0


def test_replaced_parameters_are_picked_up():
    model = seeded(TransformerStack())
    x = ids()
    with torch.no_grad():
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model), device="cpu"))
        eng.run(model, x)
        model.blocks[1].fc1.weight = nn.Parameter(model.blocks[1].fc1.weight * 2)  # a host swapping params
        assert torch.equal(eng.run(model, x), model(x))


def test_budget_config_validation():
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(budget_bytes=0)
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(budget_bytes=-5)


class PerFrameDecoder(nn.Module):
    """Runs its blocks once per frame, as the Wan VAE decoder does."""

    def __init__(self, d=32, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        frames = []
        for t in range(x.shape[1]):
            h = x[:, t]
            for b in self.blocks:
                h = torch.tanh(b(h))
            frames.append(h)
        return torch.stack(frames, 1)


def test_a_forward_that_loops_keeps_its_units_resident_instead_of_resending_them():
    model = seeded(PerFrameDecoder())
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    w = find_units(model).weight_bytes
    with torch.no_grad():
        ref = model(x)
        roomy = Engine(model, EngineConfig(budget_bytes=w + (1 << 20), device="cpu"))
        assert torch.equal(roomy.run(model, x), ref)
        assert roomy.last_plan.streamed_bytes_per_forward == 0
        assert all(u.calls == 5 for u in roomy.last_plan.units if u.name.startswith("blocks."))
        # too tight to keep them: they stream, the plan says how often, and warns
        block = find_units(model).by_name["blocks.0"].weight_bytes
        act = roomy.last_plan.activation_reserve_bytes
        tight = Engine(model, EngineConfig(budget_bytes=int(2.5 * block) + act, device="cpu"))
        with tight.session():
            assert torch.equal(tight.run(model, x), ref)
            assert torch.equal(tight.run(model, x), ref)
        plan = tight.last_plan
        assert any("enters 4 units up to 5 times" in w for w in plan.warnings)
        streamed_units = [u for u in plan.units if u.name in plan.streamed_order]
        assert plan.streamed_bytes_per_forward == sum(u.weight_bytes * 5 for u in streamed_units)
        assert tight.last_stats.bytes_streamed >= plan.streamed_bytes_per_forward - 2 * block


def test_hooks_held_between_forwards_do_nothing_for_other_callers_and_go_on_release():
    """While a session holds buffers the hooks stay on the modules; a plain call of the same
    modules in between (the host running another clone) is unaffected, and release removes them."""
    model = seeded(TransformerStack(depth=6))
    x = ids()
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        eng = Engine(model, EngineConfig(budget_bytes=budget_for(model, share=0.3), device="cpu"))
        with eng.session():
            assert torch.equal(eng.run(model, x), ref)
            assert torch.equal(eng.run(model, x), ref)
            held = eng.executor.device_bytes
            assert any(m._forward_pre_hooks for m in model.modules())
            assert torch.equal(model(x), ref)  # someone else's forward, between ours
            assert eng.executor.device_bytes == held
            assert_unchanged(model, snap)
            assert torch.equal(eng.run(model, x), ref)
        assert not any(m._forward_pre_hooks for m in model.modules())
        assert_unchanged(model, snap)


# -- merged streamed segments: one transfer per segment ----------------------------------------

def _merging_budget(model, *args):
    """With residency off: spare room for slots of a WINDOW_SHARE of it, each two units or more
    (unit bytes as the executor places them, each tensor aligned)."""
    p = _probe_plan(model, *args)
    biggest = max(u.weight_bytes for u in p.units if not u.keep_resident)
    return sum(u.weight_bytes for u in p.units if u.keep_resident) + p.activation_reserve_bytes + 9 * biggest


def _grouped(plan):
    return [g for g in plan.streamed_groups if len(g) > 1]


@pytest.mark.parametrize("name,build,inputs", cases(), ids=[c[0] for c in cases()])
def test_merged_streamed_segments_are_bit_exact_one_copy_each_and_within_the_plan(name, build, inputs):
    """Everything streamed (residency off) under a budget whose slots hold several units: each
    streamed segment is one copy per forward, the output is the plain one, and the executor's
    buffers never pass resident + window (+ subclass tensors moved beside the slots)."""
    model = build()
    args = inputs()
    with torch.no_grad():
        ref = model(*args)
        snap = snapshot(model)
        budget = _merging_budget(model, *args)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", residency=False,
                                         track_cpu_memory=True))
        stats = []
        with eng.session():
            for _ in range(4):
                assert torch.equal(eng.run(model, *args), ref), f"{name}: segmented output differs"
                stats.append(eng.last_stats)
                assert_unchanged(model, snap)
        plan = eng.last_plan
        assert _grouped(plan), f"{name}: the budget should merge streamed units"
        assert plan.transfers_per_forward < len(plan.streamed_order)
        steady = stats[-1]
        assert steady.sync_loads == 0
        if len(plan.streamed_groups) > plan.slots:
            assert steady.copies == plan.transfers_per_forward
            assert steady.bytes_streamed == plan.streamed_bytes_per_forward
        else:  # every segment stays in its own slot between forwards: nothing to copy again
            assert steady.copies <= plan.transfers_per_forward
        assert eng.stats.peak_weight_bytes <= plan.resident_bytes + plan.window_bytes + _subclass_bytes(model)
        assert_peak_within_budget(eng.stats, budget)
        assert eng.executor.device_bytes == 0


def test_merged_segments_with_skipped_and_repeated_blocks():
    """A segment whose first unit is skipped, a block run twice, an early block run again after
    later ones: each unit finds its weights in its segment's slot."""
    model = seeded(SkipRepeat())
    x = ids()
    with torch.no_grad():
        budget = _merging_budget(model, x)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", residency=False))
        with eng.session():
            assert torch.equal(eng.run(model, x), model(x))
            firsts = [g[0] for g in _grouped(eng.last_plan) if g[0].startswith("blocks.")]
            assert firsts, "the budget should merge blocks"
            model.skip = {int(firsts[0].split(".")[1])}  # the segment is entered at its second unit
            for _ in range(2):
                assert torch.equal(eng.run(model, x), model(x))
            model.skip = set()
            assert torch.equal(eng.run(model, x), model(x))
