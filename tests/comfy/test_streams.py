"""The adapter's view of the host's own GPU use (nodes/gpu.py): offload streams, weights
written in place by hook LoRAs, and memory the engines hold."""
from __future__ import annotations

import sys

import torch

import tiny_models as tm


def test_no_offload_streams_on_cpu(comfy, pack):
    gpu = sys.modules[pack.__name__ + ".nodes.gpu"]
    assert gpu.offload_streams(torch.device("cpu")) == []


def test_hook_patching_announces_the_write_and_free_memory_counts_held_weights(comfy, max_vram, pack):
    import comfy.model_management as mm

    host = sys.modules[pack.__name__ + ".nodes.patcher"]
    Engine = sys.modules[pack.__name__ + ".vramcut_core.engine"].Engine
    model = tm.load_tiny_sd3(depth=4)
    (patched, _, _), _ = max_vram(0.05, model=model)
    st = host.state_of(patched)
    engines = st.engines()
    assert engines, "the node builds the engine to show its plan"
    calls = []
    orig = Engine.weights_changed
    Engine.weights_changed = lambda self: (calls.append(self), orig(self))[1]
    key = "diffusion_model.x_embedder.proj.weight"
    weight = dict(patched.model.named_parameters())[key]
    try:
        # the host's cleanup after every run: no hooks, nothing to put back, nothing written
        patched.patch_hooks(None)
        assert calls == [], "nothing is written: the engines' copies stay good"
        # hook weights to put back (the host writes the originals into the weights in place)
        patched.hook_backup[key] = (weight.detach().clone(), weight.device)
        patched.patch_hooks(None)
    finally:
        Engine.weights_changed = orig
        patched.hook_backup.clear()
    assert calls == engines, "every engine hears of the in-place write before it happens"
    dev = torch.device("cpu")
    mm_free = mm.get_free_memory
    mm.get_free_memory = lambda *a, **k: 1 << 30
    engines[0].executor.device_bytes = 12345   # as if it held weights between forwards
    try:
        assert patched.get_free_memory(dev) == (1 << 30) + 12345
    finally:
        engines[0].executor.device_bytes = 0
        mm.get_free_memory = mm_free
