"""File-backed weights (``EngineConfig(keep_file_backed=True)``: the host streams a memory-mapped
checkpoint from a fast disk): the mapped tensors stay their own host masters (no flat host copy
of the model), their bytes reach the device through a bounded page-locked bounce buffer, and outputs
equal the plain forward. The models are loaded from checkpoint files written in the test, mapped
as the host maps them (``safetensors``, ``torch.load(mmap=True)``)."""
from __future__ import annotations

import gc

import pytest
import torch

import test_executor
from test_executor import ids
from test_sim_cuda import budget_for, cuda_engine, sim  # noqa: F401
from toys import FluxLike, TransformerStack, map_from_file, seeded
from vramcut_core import Engine, EngineConfig
from vramcut_core.runtime import host_memory as hm


def mapped(build, tmp_path, fmt="safetensors"):
    """A seeded toy whose every weight is a tensor mapped from a checkpoint file (loaded with
    ``assign``, as a host keeps a file-backed model)."""
    return map_from_file(seeded(build()), str(tmp_path), fmt)


def sim_budget(sim, build, *args):
    """The budget of ``tests/core/test_sim_cuda.py`` measured on a copy in RAM (its probe
    builds flat masters, which would take the mapped tensors' place)."""
    with sim.host_memory():
        twin = seeded(build())
    return budget_for(twin, *args)


def _fresh_ledger(monkeypatch):
    for m in list(hm._SHARED_MASTERS.values()):
        m.release()
    hm._SHARED_MASTERS.clear()
    monkeypatch.setattr(hm, "_BOUNCE", None)
    monkeypatch.setattr(hm.PAGE_LOCKED, "bytes", 0)
    monkeypatch.setattr(hm.PAGE_LOCKED, "cap", -1)


def _where(model):
    return {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("fmt", ["safetensors", "torch_mmap"])
def test_mapped_weights_are_detected_as_file_backed(tmp_path, fmt):
    model = mapped(TransformerStack, tmp_path, fmt)
    tensors = list(model.state_dict().values())
    assert all(hm.file_backed(tensors)), "tensors mapped from the checkpoint"
    assert not any(hm.file_backed([t.clone() for t in tensors])), "copies in anonymous memory"
    assert not any(hm.file_backed([torch.zeros(1 << 20), torch.empty(0)]))


def test_cpu_engine_with_file_backed_weights_equals_plain(tmp_path):
    model = mapped(TransformerStack, tmp_path)
    x = ids()
    with torch.no_grad():
        ref = model(x)
        where = _where(model)
        budget = test_executor.budget_for(seeded(TransformerStack()), x)
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", keep_file_backed=True))
        outs = [eng.run(model, x) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    assert _where(model) == where


def run_on_sim(sim, monkeypatch, model, build, args, forwards=3, **config):
    """``forwards`` forwards of ``model`` (built by ``build``, in host memory) in one session of
    a CUDA engine on the simulated accelerator, from a fresh page-lock ledger; returns the engine,
    the outputs and the plain forward's output."""
    with torch.no_grad():
        with sim.host_memory():
            ref = model(*args)
        budget = sim_budget(sim, build, *args)
        _fresh_ledger(monkeypatch)
        eng = cuda_engine(model, budget, **config)
        with eng.session():
            outs = [eng.run(model, *args) for _ in range(forwards)]
    return eng, outs, ref


@pytest.mark.parametrize("fmt", ["safetensors", "torch_mmap"])
def test_mapped_weights_stay_masters_and_only_the_bounce_buffer_is_page_locked(sim, monkeypatch, tmp_path, fmt):
    with sim.host_memory():
        model = mapped(FluxLike, tmp_path, fmt)
    where = _where(model)
    args = (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)), torch.rand(2))
    eng, outs, ref = run_on_sim(sim, monkeypatch, model, FluxLike, args, keep_file_backed=True)
    assert eng.last_plan.streamed_order, "the scenario streams"
    assert not eng.executor.masters.masters, "no flat host master was made"
    assert _where(model) == where, "the mapped tensors are still the masters"
    assert all(hm.file_backed(list(model.state_dict().values())))
    bounce = hm._BOUNCE()
    assert bounce is not None and bounce.nbytes <= hm.BOUNCE_PIECES * hm.BOUNCE_PIECE
    assert hm.PAGE_LOCKED.bytes == bounce.nbytes, "the page-locked bytes are the bounce buffer's, nothing else"
    assert all(b.data_ptr() in sim.registered for b in bounce.bufs)
    assert not sim.pageable_async
    assert all(torch.equal(o, ref) for o in outs)


def test_weights_in_ram_keep_their_flat_masters(sim, monkeypatch):
    """The option changes nothing for weights that are not file-backed."""
    with sim.host_memory():
        model = seeded(TransformerStack())
    eng, outs, ref = run_on_sim(sim, monkeypatch, model, TransformerStack, (ids(),), forwards=1,
                                keep_file_backed=True)
    assert eng.executor.masters.masters and hm._BOUNCE is None
    assert torch.equal(outs[0], ref)


def test_without_the_option_mapped_weights_are_copied_into_flat_masters(sim, monkeypatch, tmp_path):
    """Today's path (no fast disk): the flat host masters replace the mapping (the model in RAM)."""
    with sim.host_memory():
        model = mapped(TransformerStack, tmp_path)
    eng, outs, ref = run_on_sim(sim, monkeypatch, model, TransformerStack, (ids(),), forwards=1)
    assert eng.executor.masters.masters
    assert not any(hm.file_backed([m.buf for m in eng.executor.masters.masters.values()]))
    assert torch.equal(outs[0], ref)


def test_bounce_buffer_bytes_are_bounded_by_its_pieces(sim, monkeypatch, tmp_path):
    """Units larger than a piece pass through it in many pieces; the bounce buffer stays two pieces."""
    monkeypatch.setattr(hm, "BOUNCE_PIECE", 1024)
    with sim.host_memory():
        model = mapped(TransformerStack, tmp_path)
    eng, outs, ref = run_on_sim(sim, monkeypatch, model, TransformerStack, (ids(),), keep_file_backed=True)
    bounce = hm._BOUNCE()
    biggest = max(eng.executor.memory.layout(n).nbytes for n in eng.last_plan.streamed_order)
    assert biggest > 4 * bounce.piece, "the scenario needs units of many pieces"
    assert (bounce.piece, bounce.nbytes) == (1024, 2048) and hm.PAGE_LOCKED.bytes == 2048
    assert all(torch.equal(o, ref) for o in outs)


def test_a_bounce_buffer_that_cannot_be_page_locked_copies_synchronously(sim, monkeypatch, tmp_path):
    with sim.host_memory():
        model = mapped(TransformerStack, tmp_path)
    monkeypatch.setattr(hm.PAGE_LOCKED, "allows", lambda n: False)  # no page-locked room at all
    eng, outs, ref = run_on_sim(sim, monkeypatch, model, TransformerStack, (ids(),), forwards=2,
                                keep_file_backed=True)
    assert not eng.executor.masters.masters and hm._BOUNCE is None and hm.PAGE_LOCKED.bytes == 0
    assert not sim.pageable_async, "pageable sources are copied synchronously, on purpose"
    assert all(torch.equal(o, ref) for o in outs)


def test_sim_catches_bounce_piece_refilled_before_its_copy(sim, monkeypatch, tmp_path):
    """Without the wait in ``BounceBuffer.take`` the host refills a piece the copy stream has not
    read yet: the simulator reports the write, and the device receives the wrong bytes."""
    def take_without_waiting(self):
        k = self._next
        self._next = (k + 1) % len(self.bufs)
        return self.bufs[k], k

    monkeypatch.setattr(hm, "BOUNCE_PIECE", 1024)
    monkeypatch.setattr(hm.BounceBuffer, "take", take_without_waiting)
    with sim.host_memory():
        model = mapped(TransformerStack, tmp_path)
    eng, outs, ref = run_on_sim(sim, monkeypatch, model, TransformerStack, (ids(),), forwards=1,
                                keep_file_backed=True)
    assert any("write over bytes another stream may still read" in h for h in sim.hazards)
    assert not torch.equal(outs[0], ref), "the copies read pieces already refilled"
    del eng
    gc.collect()
    sim.hazards.clear()  # reported above, on purpose
