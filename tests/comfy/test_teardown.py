"""The host tears a patched model down while VRAMCut holds its weights.

ComfyUI may ``detach`` or ``unpatch_model`` a patched model at any time: between the steps of a
sampling run (the weights of an all-resident plan are held, pointing at the executor's device
copies) or from inside a forward (a node or model management reacting mid-call). The host then
moves the module to its offload device: on a GPU that copies the held device weights back to the
host for nothing (the host masters are the truth) and leaves the module pointing at those copies.
The executor's copies must be given back first (nothing copied back), a running forward must be
left alone until it ends, and the weights are the masters again afterwards: the run's latents
equal the unpatched model's, and the module is whole (objects, memory, values).

On CPU the move itself copies nothing, so the tests record what the host's move would have
touched: a move of the module while an engine holds or runs its weights is the defect.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm

LATENT = (1, 16, 8, 8)


def snapshot(module):
    return {n: (t, t.device, t.data_ptr(), t.detach().clone()) for n, t in
            list(module.named_parameters()) + list(module.named_buffers())}


def assert_same(module, snap):
    now = dict(list(module.named_parameters()) + list(module.named_buffers()))
    for n, (t, dev, ptr, vals) in snap.items():
        assert now[n] is t and now[n].device == dev, n
        assert now[n].data_ptr() == ptr, f"{n}: points at other memory (held weights not given back?)"
        assert torch.equal(now[n].detach(), vals), n


def sample(model, pos, neg, latent_shape, steps, callback):
    import comfy.sample
    latent = comfy.sample.fix_empty_latent_channels(model, torch.zeros(tuple(latent_shape)))
    noise = comfy.sample.prepare_noise(latent, 0)
    return comfy.sample.sample(model, noise, steps, 2.0, "euler", "simple", pos, neg, latent,
                               denoise=1.0, disable_pbar=True, seed=0, callback=callback)


def engines(pack, patched):
    return list(pack.nodes.patcher.state_of(patched)._engines.values())


def watch_moves(pack, patched):
    """Record, for every move of the module by the host, whether an engine held or ran its
    weights at that moment."""
    moves = []
    base = patched.model
    orig = base.to

    def to(*args, **kwargs):
        moves.append([(e.executor.holds_weights, e.executor.running) for e in engines(pack, patched)])
        return orig(*args, **kwargs)

    base.to = to
    return moves


def setup(comfy, max_vram, pack):
    model = tm.load_tiny_sd3(depth=4, seed=5)
    pos, neg = tm.tiny_sd3_conditioning()
    ref = tm.sample(model, pos, neg, LATENT, steps=4)
    module = model.model.diffusion_model
    snap = snapshot(module)
    (patched, _, _), payload = max_vram(8.0, model=model)
    assert payload["models"][0]["plan"]["streamed_bytes_per_forward"] == 0, "the budget should keep all resident"
    return model, patched, module, snap, ref, pos, neg


def no_move_while_held(moves):
    bad = [m for m in moves if any(h or r for h, r in m)]
    assert not bad, f"the host moved the module while an engine held (or ran) its weights: {bad}"


@pytest.mark.parametrize("how", ["detach", "unpatch_model"])
def test_teardown_between_steps_gives_held_weights_back_first(comfy, max_vram, pack, how):
    model, patched, module, snap, ref, pos, neg = setup(comfy, max_vram, pack)
    moves = watch_moves(pack, patched)
    done = []

    def step(i, *_a):
        if i == 1 and not done:
            assert any(e.executor.holds_weights for e in engines(pack, patched)), "the scenario needs held weights"
            if how == "detach":
                patched.detach(unpatch_all=True)
            else:
                patched.unpatch_model(patched.offload_device, unpatch_weights=True)
            done.append(True)
            assert not any(e.executor.holds_weights for e in engines(pack, patched))
            assert_same(module, snap)   # the masters again, right after the teardown

    out = sample(patched, pos, neg, LATENT, 4, step)
    assert done
    assert torch.equal(out, ref), f"max diff {(out - ref).abs().max()}"
    no_move_while_held(moves)
    assert not any(e.executor.holds_weights for e in engines(pack, patched))
    assert_same(module, snap)


@pytest.mark.parametrize("how", ["detach", "unpatch_model"])
def test_teardown_inside_a_forward_waits_for_it(comfy, max_vram, pack, how):
    """Called from inside a forward: the running forward keeps its weights, nothing is moved
    under it, and its device copies are given back once it has ended."""
    model, patched, module, snap, ref, pos, neg = setup(comfy, max_vram, pack)
    moves = watch_moves(pack, patched)
    calls, after = [], []
    block = module.joint_blocks[1]

    def hook(_mod, _args, _out):
        if len(calls) == 0 and any(e.executor.running for e in engines(pack, patched)):
            if how == "detach":
                patched.detach(unpatch_all=True)
            else:
                patched.unpatch_model(patched.offload_device, unpatch_weights=True)
            calls.append(True)

    def step(i, *_a):   # the step whose forward saw the teardown has ended
        if calls and not after:
            after.append([(e.executor.device_bytes, e.executor.holds_weights) for e in engines(pack, patched)])

    h = block.register_forward_hook(hook)
    try:
        out = sample(patched, pos, neg, LATENT, 4, step)
    finally:
        h.remove()
    assert calls, "the teardown ran inside a forward"
    assert after and all(held == (0, False) for held in after[0]), f"not given back once the forward ended: {after}"
    assert torch.equal(out, ref), f"max diff {(out - ref).abs().max()}"
    no_move_while_held(moves)
    assert not any(e.executor.holds_weights for e in engines(pack, patched))
    assert_same(module, snap)


def test_teardown_after_the_run_moves_nothing_held(comfy, max_vram, pack):
    model, patched, module, snap, ref, pos, neg = setup(comfy, max_vram, pack)
    out = sample(patched, pos, neg, LATENT, 4, None)
    moves = watch_moves(pack, patched)
    patched.detach(unpatch_all=True)
    assert torch.equal(out, ref)
    no_move_while_held(moves)
    assert_same(module, snap)
