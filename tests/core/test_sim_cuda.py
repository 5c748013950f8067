"""The executor's CUDA branch on the simulated accelerator (tests/sim_cuda.py).

Every scenario checks: output bit-equal to the plain forward, no happens-before hazard, the
module restored, and the simulated allocator's reserved peak over the whole run (plan switches
included) within the budget. Tests named ``test_<hazard>`` show a fix; tests named
``test_sim_catches_*`` take a synchronisation point out and show the simulator fails the run.
"""
import gc

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from sim_cuda import ROUND, PendingCudaError, simulated_cuda
from test_executor import cases, ids
from toys import Boom, ExplodingStack, FluxLike, TransformerStack, seeded
from vramcut_core import Engine, EngineConfig, HostHooks, find_units
from vramcut_core.runtime import device_memory, host_memory, transfers


@pytest.fixture
def sim(monkeypatch):
    with simulated_cuda(monkeypatch) as s:
        yield s
        gc.collect()
    assert not s.hazards, "hazards:\n" + "\n".join(s.hazards[:10])


def values(model):
    return {n: (t, t.detach().clone()) for n, t in
            list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))}


def assert_restored(model, snap, sim):
    """Same objects, same values, nothing left pointing at device memory (host masters may have
    moved the tensors into one flat buffer per unit: that is their design on CUDA)."""
    now = dict(list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)))
    for n, (t, v) in snap.items():
        assert now[n] is t, f"{n}: object replaced"
        assert not sim.is_device(t), f"{n}: left on the device"
        a, b = t.detach(), v
        if a.dtype.itemsize == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"{n}: values changed"


def budget_for(model, *args, share=0.45, streams=None):
    """As tests/core/test_executor.py's, with the activations the simulated allocator measures."""
    us = find_units(model)
    biggest = max(u.weight_bytes for u in us.units if not u.keep_resident)
    pinned = sum(u.weight_bytes for u in us.units if u.keep_resident)
    act = probe_plan(model, *(args or (ids(),)), streams=streams).activation_reserve_bytes
    return max(int(us.weight_bytes * share) + act, pinned + 2 * biggest + biggest // 2 + act)


def probe_plan(model, *args, streams=None):
    """The measured plan of one forward of ``args`` on the simulated device, everything fitting
    (its buffers given back)."""
    probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cuda"), host=HostHooks(reader_streams=streams))
    with torch.no_grad():
        probe.run(model, *args)
    probe.release()
    return probe.last_plan


def reference(sim, build, inputs):
    """A toy built in host memory, its inputs, its plain output and its values."""
    with sim.host_memory(), torch.no_grad():
        model = build()
        args = inputs()
        return model, args, model(*args), values(model)


def fresh_peak(sim) -> int:
    """Empty the allocator's cache and its peak; the reserved bytes a run starts from."""
    sim.alloc.empty_cache()
    sim.alloc.reset_peak()
    return sim.alloc.reserved


def cuda_engine(model, budget, **kw):
    return Engine(model, EngineConfig(budget_bytes=budget, device="cuda", **kw))


def reserved_peak_within(sim, budget, base, held=()):
    """Reserved bytes over the run, plan switches included, within the budget (the plan counts
    the allocator's rounding); outputs the caller keeps from earlier forwards are its own memory
    (they can leave a hole below the next forward's blocks)."""
    slack = sum(-(-o.untyped_storage().nbytes() // ROUND) * ROUND for o in held)  # (as the allocator counts them)
    assert sim.alloc.max_reserved - base <= budget + slack, \
        f"reserved peak {sim.alloc.max_reserved - base} B over the {budget} B budget; at the peak: {sim.alloc.at_peak}"


# -- every toy family ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,build,inputs", cases(), ids=[c[0] for c in cases()])
def test_cuda_branch_bit_exact_no_hazards_reserved_within_budget(sim, name, build, inputs):
    model, args, ref, snap = reference(sim, build, inputs)
    with torch.no_grad():
        budget = budget_for(model, *args)
        eng = cuda_engine(model, budget)
        base = fresh_peak(sim)
        with eng.session():
            outs = [eng.run(model, *args) for _ in range(3)]
            assert_restored(model, snap, sim)
        for o in outs:
            assert torch.equal(o, ref), f"{name}: output differs on the CUDA branch"
        assert eng.last_plan.streamed_bytes_per_forward > 0
        assert eng.executor.device_bytes == 0
        reserved_peak_within(sim, budget, base, held=outs)
    assert_restored(model, snap, sim)


# -- findings -----------------------------------------------------------------------------------

def test_pending_register_error_is_cleared(sim):
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    with torch.no_grad():
        sim.register_error = lambda ptr, size: 2   # cudaErrorMemoryAllocation (pinned limit)
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            outs = [eng.run(model, x) for _ in range(3)]
    assert sim.register_calls, "registration was tried"
    assert sim.pending_error is None
    assert not sim.registered
    assert all(torch.equal(o, ref) for o in outs)


def test_sim_catches_pending_register_error(sim, monkeypatch):
    monkeypatch.setattr(host_memory, "_clear_cuda_error", lambda place: None)
    with sim.host_memory():
        model = seeded(TransformerStack())
    with torch.no_grad():
        budget = budget_for(model)
        sim.register_error = lambda ptr, size: 2
        eng = cuda_engine(model, budget)
        for m in list(host_memory._SHARED_MASTERS.values()):   # the probe's masters: build them again
            m.release()
        host_memory._SHARED_MASTERS.clear()
        eng.executor.forget_units()
        with pytest.raises(PendingCudaError):
            eng.run(model, ids())


def test_pinned_bytes_are_capped_and_registration_is_portable(sim, monkeypatch):
    monkeypatch.setattr(host_memory.PAGE_LOCKED, "cap", 20_000)
    monkeypatch.setattr(host_memory.PAGE_LOCKED, "bytes", 0)
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            outs = [eng.run(model, x) for _ in range(2)]
        assert 0 < sum(size for size, _ in sim.registered.values()) <= 20_000
        assert host_memory.PAGE_LOCKED.bytes <= 20_000
        assert all(flags & 1 for _, _, flags in sim.register_calls), "cudaHostRegisterPortable"
    assert all(torch.equal(o, ref) for o in outs)
    del eng
    gc.collect()
    assert not sim.registered and host_memory.PAGE_LOCKED.bytes == 0


def test_pageable_masters_copy_through_a_staging_buffer(sim):
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    with torch.no_grad():
        sim.register_error = lambda ptr, size: 2
        eng = cuda_engine(model, budget_for(model, x))
        staged = []
        orig = torch.Tensor.pin_memory

        def counting(self, *a, **k):
            staged.append(self.numel())
            return orig(self, *a, **k)

        torch.Tensor.pin_memory = counting
        try:
            with eng.session():
                outs = [eng.run(model, x) for _ in range(2)]
        finally:
            torch.Tensor.pin_memory = orig
        assert staged, "a pageable master is staged through page-locked memory"
        sim.pin_memory_fails = True   # and when that fails too, the copy still lands
        with eng.session():
            outs += [eng.run(model, x)]
    assert all(torch.equal(o, ref) for o in outs)


class CastLinear(nn.Module):
    """A linear layer whose weight is cast per forward by the host (fp16 weights, fp32 input)."""

    def __init__(self, d, host):
        super().__init__()
        self.host = [host]
        self.weight = nn.Parameter(torch.randn(d, d, dtype=torch.float16) * 0.1, requires_grad=False)
        self.bias = nn.Parameter(torch.randn(d, dtype=torch.float16) * 0.1, requires_grad=False)

    def forward(self, x):
        w, b = self.host[0].cast_bias_weight(self, x)
        return torch.nn.functional.linear(x, w, b)


class HostCasts:
    """An imitation of ComfyUI's offload-stream casts (comfy/ops.py ``cast_bias_weight``,
    comfy/model_management.py ``get_offload_stream``, ``cast_to``, ``sync_stream``).

    ``"0.3.64"``: with async offload on, every cast takes an offload stream, even for a weight
    already on the device; the streams are made lazily, and each call makes the *next* stream
    wait for the compute stream. ``"0.33.0"``: an offload stream only for a weight not on the
    device (the oldest stream waits for compute, the next one is returned)."""

    def __init__(self, sim, behaviour, n=2):
        self.sim, self.behaviour, self.n = sim, behaviour, n
        self.streams = None
        self.counter = 0
        self.casts_on_streams = 0

    def get_offload_stream(self):
        if self.streams is None:
            self.streams = [torch.cuda.Stream() for _ in range(self.n)]
            s = self.streams[self.counter]
            self.counter = (self.counter + 1) % self.n
            return s
        if self.behaviour == "0.3.64":
            s = self.streams[self.counter]
            self.counter = (self.counter + 1) % self.n
            self.streams[self.counter].wait_stream(torch.cuda.current_stream())
            return s
        self.streams[self.counter].wait_stream(torch.cuda.current_stream())
        self.counter = (self.counter + 1) % self.n
        return self.streams[self.counter]

    def cast_to(self, weight, dtype, stream):
        if weight.dtype == dtype:
            return weight
        if stream is not None:
            self.casts_on_streams += 1
            with stream:
                return weight.to(dtype=dtype)
        return weight.to(dtype=dtype)

    def cast_bias_weight(self, s, x):
        # the host compares devices: the engine's dry run fakes weights on the compute device
        on_device = self.sim.is_device(s.weight) or isinstance(s.weight, FakeTensor)
        if self.behaviour == "0.3.64" or not on_device:
            stream = self.get_offload_stream()
        else:
            stream = None
        b = self.cast_to(s.bias, x.dtype, stream)
        w = self.cast_to(s.weight, x.dtype, stream)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)   # sync_stream
        return w, b

    def reader_streams(self):
        """What the adapter hands the engine (nodes/gpu.py): the host's streams, made first."""
        if self.streams is None:
            self.get_offload_stream()
        return list(self.streams)


class CastStack(nn.Module):
    def __init__(self, host, d=16, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(CastLinear(d, host), nn.GELU()) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _cast_run(sim, behaviour, ordered):
    host = HostCasts(sim, behaviour)
    with sim.host_memory(), torch.no_grad():
        torch.manual_seed(0)
        model = CastStack(host).eval()
        x = torch.randn(4, 16)
        expect = model(x)
        torch.cuda.synchronize()   # the host reads the reference: its casts have finished
    with torch.no_grad():
        # the host's casts allocate on its streams: room for them beside the window
        budget = budget_for(model, x, streams=host.reader_streams if ordered else None) + 4096
        host.casts_on_streams = 0
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cuda"),
                     host=HostHooks(reader_streams=host.reader_streams if ordered else None))
        with eng.session():
            outs = [eng.run(model, x) for _ in range(3)]
    return host, outs, expect


@pytest.mark.parametrize("behaviour", ["0.3.64", "0.33.0"])
def test_host_offload_stream_ordered_after_copy(sim, behaviour):
    host, outs, expect = _cast_run(sim, behaviour, ordered=True)
    if behaviour == "0.3.64":
        assert host.casts_on_streams > 0, "the imitation casts device weights on offload streams"
    else:
        assert host.casts_on_streams == 0, "0.33.0 takes no offload stream for a weight on the device"
    for o in outs:
        assert torch.equal(o, expect)


def test_sim_catches_host_offload_stream_not_ordered(sim):
    host, outs, expect = _cast_run(sim, "0.3.64", ordered=False)
    assert sim.hazards and any("before its write is ordered" in h for h in sim.hazards)
    sim.hazards.clear()


def test_sim_catches_compute_not_waiting_for_copy(sim, monkeypatch):
    def no_wait(self, ready):
        pass

    monkeypatch.setattr(transfers.Transfers, "order_readers", no_wait)
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            out = eng.run(model, x)
    assert any("before its write is ordered" in h for h in sim.hazards)
    assert not torch.equal(out, ref), "reading a slot before its copy landed reads stale bytes"
    sim.hazards.clear()


def test_sim_catches_copy_not_waiting_for_compute(sim):
    with sim.host_memory():
        model = seeded(TransformerStack(depth=8))
        x = ids()
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        eng.executor.transfers.copy_stream.wait_event = lambda ev: None
        with eng.session():
            for _ in range(3):
                eng.run(model, x)
    assert any("write over bytes another stream may still read" in h for h in sim.hazards)
    sim.hazards.clear()


def test_plan_switch_frees_before_alloc(sim):
    """Measuring plan (one slot) -> measured plan (residents + two slots): the old buffers are
    gone before the new ones are allocated, in allocated and in reserved bytes."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(FluxLike(d=48))
        g = torch.Generator().manual_seed(3)
        args = (torch.randn(2, 5, 16, generator=g), torch.rand(2, generator=g))
        ref = model(*args)
        ref1 = model(args[0][:1], args[1][:1])
    with torch.no_grad():
        budget = budget_for(model, *args)
        eng = cuda_engine(model, budget)
        seen = []
        orig = device_memory.DeviceMemory.alloc

        def alloc(self, n):
            buf = orig(self, n)
            seen.append(sim.alloc.allocated)
            return buf

        device_memory.DeviceMemory.alloc = alloc
        try:
            base = fresh_peak(sim)
            with eng.session():
                for _ in range(3):
                    assert torch.equal(eng.run(model, *args), ref)
                assert torch.equal(eng.run(model, args[0][:1], args[1][:1]), ref1)
        finally:
            device_memory.DeviceMemory.alloc = orig
    assert max(seen) - base <= budget
    assert sim.alloc.max_allocated - base <= budget
    reserved_peak_within(sim, budget, base)


def test_inplace_host_update_between_forwards(sim):
    """A hook LoRA writes into the weights between forwards: the adapter says so first (the
    patcher's ``patch_hooks``), the engine waits for copies reading the masters and copies the
    held weights again."""
    with sim.host_memory():
        model = seeded(TransformerStack())
        x = ids()
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x, share=0.7))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            assert eng.last_plan.resident_units, "the scenario needs held resident copies"
            eng.weights_changed()
            with sim.host_memory():
                for p in model.parameters():
                    p.data.mul_(1.5)
                updated = model(x)
            fresh = eng.run(model, x)
            again = eng.run(model, x)
    assert torch.equal(fresh, updated) and torch.equal(again, updated)


def test_sim_catches_host_write_during_prefetch(sim):
    with sim.host_memory():
        model = seeded(TransformerStack())
        x = ids()
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            with sim.host_memory():
                for p in model.parameters():   # not announced: copies in flight read these
                    p.data.mul_(1.5)
            eng.run(model, x)
    found = any("write over bytes another stream may still read" in h for h in sim.hazards)
    sim.hazards.clear()
    assert found, "the host wrote into a master while the prefetch copy still read it"


def test_gc_without_release_unpins(sim):
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        eng.keep_buffers(True)            # an interrupted upscale: buffers and hooks held
        eng.run(model, x)
        eng.run(model, x)
        assert sim.registered and eng.executor.device_bytes
        del eng
        gc.collect()
        assert not sim.registered, "pinned masters must be unregistered when the executor goes"
        assert all(not m._forward_pre_hooks for m in model.modules()), "hooks must go with it"
        assert torch.equal(model(x), ref)


def test_two_engines_one_module(sim):
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack(depth=8))
        x = ids()
        ref = model(x)
    with torch.no_grad():
        budget = budget_for(model, x)
        a, b = cuda_engine(model, budget), cuda_engine(model, budget)
        a.keep_buffers(True)
        b.keep_buffers(True)
        base = fresh_peak(sim)
        outs = [a.run(model, x), a.run(model, x)]
        outs += [b.run(model, x), b.run(model, x)]   # a gives its buffers back first
        assert a.executor.device_bytes == 0 and b.executor.device_bytes > 0
        regs = dict(sim.registered)
        a.release()                                   # b's prefetch still reads the masters
        assert sim.registered == regs, "one engine's release must not unpin the other's masters"
        outs += [b.run(model, x), a.run(model, x), b.run(model, x)]
        a.keep_buffers(False)
        b.keep_buffers(False)
    assert all(torch.equal(o, ref) for o in outs)
    reserved_peak_within(sim, budget, base, held=outs)


def test_interrupt_mid_forward_restores_without_hazards(sim):
    with sim.host_memory(), torch.no_grad():
        model = seeded(ExplodingStack(at=3))
        x = ids()
        ref = model(x)
        snap = values(model)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            model.armed = True
            with pytest.raises(Boom):
                eng.run(model, x)
            model.armed = False
            assert_restored(model, snap, sim)
            assert torch.equal(eng.run(model, x), ref)
        assert eng.executor.device_bytes == 0


def test_masters_kept_across_sessions(sim):
    with sim.host_memory():
        model = seeded(TransformerStack())
        x = ids()
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
        n = len(sim.register_calls)
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
        assert len(sim.register_calls) == n, "a new session re-pinned the masters"


def test_steady_forwards_do_not_wait_on_the_host_and_read_their_peak(sim):
    """A steady forward reads the allocator's peak (a statistics call, no host sync): the peak it
    reports is its own, within the budget and never 0."""
    with sim.host_memory():
        model = seeded(TransformerStack())
        x = ids()
    with torch.no_grad():
        budget = budget_for(model, x)
        eng = cuda_engine(model, budget)
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            syncs = sim.host_syncs
            for _ in range(3):
                eng.run(model, x)
                assert 0 < eng.last_stats.peak_device_bytes <= budget
                assert eng.last_stats.peak_device_bytes >= eng.executor.device_bytes
            assert sim.host_syncs == syncs, "a steady forward made the host wait for the GPU"
    assert eng.stats.forwards == 5


def test_masters_built_in_inference_mode_are_not_inference_tensors(sim):
    with sim.host_memory():
        model = seeded(TransformerStack())
        x = ids()
    with torch.inference_mode():
        eng = cuda_engine(model, budget_for(model, x))
        eng.run(model, x)
    assert sim.registered
    assert not any(p.is_inference() for p in model.parameters())
    out = model(x).sum()
    assert out.requires_grad, "training after sampling still works"


def test_held_bytes(sim):
    with sim.host_memory():
        model = seeded(TransformerStack())
        x = ids()
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
            assert eng.held_bytes == eng.executor.device_bytes > 0
        assert eng.held_bytes == 0


def test_weights_the_host_pinned_are_copied_from_where_they_are(sim):
    """Newer hosts page-lock offloaded weights themselves: no second host copy is made."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    rt = torch.cuda.cudart()
    ptrs = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    for ptr, n in ptrs.items():
        rt.cudaHostRegister(ptr, n, 0)
    calls = len(sim.register_calls)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            outs = [eng.run(model, x) for _ in range(3)]
        assert len(sim.register_calls) == calls, "weights already page-locked are not copied again"
        assert all(torch.equal(o, ref) for o in outs)
    torch.cuda.synchronize()
    for ptr in ptrs:
        rt.cudaHostUnregister(ptr)


def test_a_unit_the_host_page_locked_in_part_streams_without_a_host_wait(sim):
    """ComfyUI page-locks the weights and biases of its own layers, not a block's other
    parameters (Wan's ``modulation``, norms of plain torch modules): the pageable rest of a
    streamed unit goes through torch's page-locked staging, so a steady forward never waits."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    rt = torch.cuda.cudart()
    linear = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    ptrs = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in linear}
    for ptr, n in ptrs.items():
        rt.cudaHostRegister(ptr, n, 0)
    assert any(not p.is_pinned() for p in model.parameters()), "some of a unit's tensors stay pageable"
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            outs = [eng.run(model, x) for _ in range(2)]
            syncs = sim.host_syncs
            outs += [eng.run(model, x) for _ in range(2)]
            assert sim.host_syncs == syncs, "a steady forward waited for a pageable copy"
            assert eng.last_stats.bytes_streamed > 0
        assert all(torch.equal(o, ref) for o in outs)
    torch.cuda.synchronize()
    for ptr in ptrs:
        rt.cudaHostUnregister(ptr)


def test_masters_rebuilt_when_the_host_moves_the_weights(sim):
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            eng.run(model, x)
            eng.run(model, x)
        with sim.host_memory():
            for p in model.parameters():      # the host loads other storage into the same objects
                p.data = p.data.clone()
        with eng.session():
            outs = [eng.run(model, x) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)


@pytest.mark.parametrize("how", ["raises", "unregistered_by_someone_else"])
def test_registration_failures_of_every_kind_leave_no_pending_error(sim, how):
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        x = ids()
        ref = model(x)
    with torch.no_grad():
        budget = budget_for(model, x)
        for m in list(host_memory._SHARED_MASTERS.values()):
            m.release()
        host_memory._SHARED_MASTERS.clear()
        eng = cuda_engine(model, budget)
        if how == "raises":
            def boom(ptr, size):
                raise RuntimeError("cudaHostRegister binding failed")
            sim.register_error = boom
        with eng.session():
            outs = [eng.run(model, x) for _ in range(2)]
        if how == "unregistered_by_someone_else":
            torch.cuda.synchronize()
            for ptr in list(sim.registered):
                torch.cuda.cudart().cudaHostUnregister(ptr)
        eng.executor.forget_units()        # unregisters what it holds: fails for each
        assert sim.pending_error is None
        outs.append(eng.run(model, x))
    assert all(torch.equal(o, ref) for o in outs)


class Wrapped(torch.Tensor):
    """A wrapper subclass with its own dispatch and no flatten protocol: the executor cannot take
    it apart, so it is moved as a whole beside the unit's flat copy."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        unwrap = lambda x: x.inner if isinstance(x, Wrapped) else x
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.detach.default, torch.ops.aten.clone.default):
            return Wrapped(out)
        return out


def test_weights_that_cannot_be_taken_apart_on_the_cuda_branch(sim):
    """Moved one by one beside the slot, on the copy stream, announced to the compute stream
    (record_stream): bit-equal, no hazard, restored."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        for blk in model.blocks:
            lin = blk.fc1 if hasattr(blk, "fc1") else next(m for m in blk.modules() if isinstance(m, nn.Linear))
            lin._parameters["weight"] = Wrapped(lin.weight.detach().clone())
        from vramcut_core.model import quant
        assert quant.parts(lin._parameters["weight"]) is None
        x = ids()
        ref = model(x)
        snap = values(model)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            outs = [eng.run(model, x) for _ in range(3)]
        assert all(torch.equal(o, ref) for o in outs)
        assert eng.last_plan.streamed_bytes_per_forward > 0
        assert "Wrapped" in sim.recorded_types, "a weight moved as a whole must be announced to the compute stream"
        assert any("Wrapped" in w and "cannot be taken apart" in w for w in eng.last_plan.warnings)
    assert_restored(model, snap, sim)


def test_a_streamed_unit_with_no_plain_tensors_has_no_host_master(sim):
    """Every weight of the blocks moved as a whole: nothing to put in a flat host master, so
    none is built (nothing is page-locked for them); bit-equal, no hazard, restored."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(TransformerStack())
        for m in model.blocks.modules():
            m._parameters.update({k: Wrapped(t.detach().clone()) for k, t in m._parameters.items() if t is not None})
        x = ids()
        ref, snap = model(x), values(model)
    with torch.no_grad():
        eng = cuda_engine(model, budget_for(model, x))
        with eng.session():
            assert all(torch.equal(eng.run(model, x), ref) for _ in range(3))
            streamed = [u for u in eng.last_plan.streamed_order if u.startswith("blocks.")]
            assert streamed and all(eng.executor.masters.get(u) is None for u in streamed)
    assert_restored(model, snap, sim)


# -- merged streamed segments: a segment's units copied back to back, one event -----------------

def merging_budget(model, *args):
    """Residency off, and spare room for slots of two units or more (see plan.WINDOW_SHARE)."""
    p = probe_plan(model, *args)
    biggest = max(u.weight_bytes for u in p.units if not u.keep_resident)
    return sum(u.weight_bytes for u in p.units if u.keep_resident) + p.activation_reserve_bytes + 9 * biggest


@pytest.mark.parametrize("name,build,inputs", cases(), ids=[c[0] for c in cases()])
def test_merged_segments_bit_exact_no_hazards_one_copy_each(sim, name, build, inputs):
    model, args, ref, snap = reference(sim, build, inputs)
    with torch.no_grad():
        budget = merging_budget(model, *args)
        eng = cuda_engine(model, budget, residency=False)
        base = fresh_peak(sim)
        with eng.session():
            outs = [eng.run(model, *args) for _ in range(4)]
            steady = eng.last_stats
            assert_restored(model, snap, sim)
        plan = eng.last_plan
        assert any(len(g) > 1 for g in plan.streamed_groups), f"{name}: nothing merged"
        for o in outs:
            assert torch.equal(o, ref), f"{name}: output differs on the CUDA branch"
        if len(plan.streamed_groups) > plan.slots:
            assert steady.copies == plan.transfers_per_forward
        assert steady.sync_loads == 0
        assert eng.executor.device_bytes == 0
        reserved_peak_within(sim, budget, base, held=outs)
    assert_restored(model, snap, sim)


class SkipFirst(TransformerStack):
    def __init__(self):
        super().__init__(depth=8)
        self.skip = set()

    def forward(self, ids):
        x = self.embed(ids)
        for i, b in enumerate(self.blocks):
            if i not in self.skip:
                x = b(x)
        return self.head(self.norm_out(x))


def skip_first_merged(sim):
    """SkipFirst in host memory, its input, and an engine (residency off) whose streamed
    segments hold several blocks."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(SkipFirst())
        x = ids()
    return model, x, cuda_engine(model, merging_budget(model, x), residency=False)


def segment_heads(plan) -> list[int]:
    """Indices of the blocks that begin a streamed segment of several units."""
    return [int(g[0].split(".")[1]) for g in plan.streamed_groups if len(g) > 1 and g[0].startswith("blocks.")]


def test_a_segment_entered_at_its_second_unit_waits_for_the_segment_copy(sim):
    """Its first unit skipped: compute reads the second unit's copy, which the segment's one
    event orders (the simulator fails any read before that)."""
    model, x, eng = skip_first_merged(sim)
    with torch.no_grad():
        with eng.session():
            eng.run(model, x)
            heads = segment_heads(eng.last_plan)
            assert heads
            model.skip = {heads[-1]}
            with sim.host_memory():
                ref = model(x)
            for _ in range(3):
                assert torch.equal(eng.run(model, x), ref)


def test_sim_catches_a_segment_copy_whose_later_units_are_not_ordered(sim, monkeypatch):
    """Take the segment's event off every unit but the first: a forward that enters the segment
    at its second unit reads it before its copy is ordered."""
    orig = transfers.Transfers.load

    def first_only(self, names, buf, sync, free=None):
        out = orig(self, names, buf, sync, free)
        for n in list(out)[1:]:
            out[n].ready = None
        return out

    monkeypatch.setattr(transfers.Transfers, "load", first_only)
    model, x, eng = skip_first_merged(sim)
    with torch.no_grad():
        with eng.session():
            eng.run(model, x)
            model.skip = set(segment_heads(eng.last_plan))
            for _ in range(3):
                eng.run(model, x)
    assert any("before its write is ordered" in h for h in sim.hazards)
    sim.hazards.clear()
