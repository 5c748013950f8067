"""nvfp4 weights with a LoRA on the simulated accelerator (``tests/sim_cuda.py``; the host
believes its main device is ``cuda:0``): the tiny SD3 model stored in nvfp4 by the host's own
comfy-kitchen layout class, loaded by UNETLoader, a LoRA applied before or after the Max VRAM
node, loaded by the host (``load_models_gpu``) and called through its ``apply_model`` inside a
sampling run. Each unit's device copy is dequantised, patched and requantised as it arrives (the
host's own merge); every call is bit-equal to the host's own merge of the same LoRA on the CPU,
its reserved peak within the budget, with no hazard. The budget is the one the pack names when
it refuses a smaller one: the number works here too. Hosts without nvfp4 skip and say why."""
from __future__ import annotations

import gc

import pytest
import torch

import tiny_models as tm
from host_cases import call, quantized_cases, sampling, simulated_host

GIB = 1 << 30
CALLS = 3


def _g(seed):
    return torch.Generator().manual_seed(seed)


def inputs():
    return (torch.randn(1, 16, 8, 8, generator=_g(1)), torch.full((1,), 0.7),
            {"c_crossattn": torch.randn(1, 8, 32, generator=_g(2)), "y": torch.randn(1, 32, generator=_g(3))})


@pytest.mark.parametrize("order", ["lora_then_vramcut", "vramcut_then_lora"])
def test_nvfp4_lora_on_the_simulated_accelerator_bit_exact_within_budget(comfy, pack, max_vram, monkeypatch,
                                                                          tmp_path, order):
    import comfy.model_management as mm
    import comfy.sd

    q = quantized_cases()
    why = q._kitchen_missing("nvfp4")
    if why:
        pytest.skip(f"nvfp4: {why}")
    with simulated_host(monkeypatch, pack) as sim:
        # the merge computes in the host's LoRA precision for the device: the CPU's, as the reference
        monkeypatch.setitem(mm.LORA_COMPUTE_DTYPES, torch.device("cuda", 0), torch.float32)
        with sim.host_memory():
            model = q.load_format("nvfp4", tmp_path)
            # the weights in fresh memory, as a GPU host has them: a CPU matrix product rounds by
            # the weight's address (its 16-byte alignment), and a file maps some weights misaligned
            model.model.diffusion_model._apply(lambda t: t.clone())
            assert q.quantized_params(model), "the loader produced no nvfp4 weights"
            lora = tm.tiny_lora_for(tm.tiny_sd3_state_dict(depth=q.DEPTH, seed=0), seed=3)
            with_lora = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]
            base = model.model
            host_in = inputs()
            with torch.no_grad():
                plain = base.apply_model(host_in[0], host_in[1], **host_in[2])
                with_lora.patch_model(device_to=torch.device("cpu"))   # the host's own merge, on the CPU
                try:
                    ref = base.apply_model(host_in[0], host_in[1], **host_in[2])
                finally:
                    with_lora.unpatch_model()
            assert not torch.equal(ref, plain), "the LoRA must matter"
        for p in (model, with_lora):
            p.load_device = torch.device("cuda", 0)   # a CUDA host's load device
        xs = inputs()   # made outside host memory: the device's

        def patched_at(gb, node_id):
            if order == "lora_then_vramcut":
                return max_vram(gb, model=with_lora, node_id=node_id)
            (p0, _, _), payload = max_vram(gb, model=model, node_id=node_id)
            return (comfy.sd.load_lora_for_models(p0, None, lora, 1.0, 0)[0], None, None), payload

        def run(clone, steps):
            mm.load_models_gpu([clone])
            with torch.no_grad():
                return sampling(clone, steps)

        # from a budget too small, the numbers the pack names, followed until one runs: on a GPU the
        # dry run's number is a floor (the first forward measures the allocator's own figures, the
        # blocks the merge's temporaries leave included) and a stop there names the next
        gb, named, alloc = q.budget_for(model), [], sim.alloc
        for i in range(3):
            (clone, _, _), payload = patched_at(gb, str(i))
            alloc.empty_cache()
            base0, outs, peaks = alloc.reserved, [], []

            def steps():
                for _ in range(CALLS):
                    alloc.reset_peak()
                    outs.append(call(base, clone, xs))
                    peaks.append(alloc.max_reserved - base0)

            try:
                run(clone, steps)
                break
            except ValueError as e:
                m = q.SMALLEST.search(str(e))
                assert m and float(m.group(1)) > gb, str(e)
                named.append(m.group(0))
                gb = float(m.group(1))
                pack.nodes.state.state_of(clone).release()
                del clone, e
                gc.collect()
        else:
            pytest.fail(f"no number the pack named ran: {named}")
        budget = int(gb * GIB)
        for i, out in enumerate(outs, 1):
            assert torch.equal(out, ref), f"call {i}: max |diff| {(out - ref).abs().max()}"
        assert all(p <= budget for p in peaks), f"reserved peaks {peaks} over the budget {budget}"
        plan = payload["models"][0]["plan"]
        assert plan["streamed_bytes_per_forward"] > 0, "the budget must stream"
        # the host unloads the patched model and it goes while the simulated device is there
        # (its engines keep their copies between prompts until then)
        mm.unload_all_models()
        del clone
        gc.collect()
        print(f"\nnvfp4 + LoRA on the simulated accelerator ({order}): named {named}, ran at {gb} GiB, "
              f"reserved peaks {peaks}")
