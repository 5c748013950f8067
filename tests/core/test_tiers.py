"""Host tiers under a RAM budget (``EngineConfig(ram_budget_bytes=...)``): units whose host copy
does not fit are read from their file each call (the checkpoint where the tensor is mapped from
it, else the model's cache file), outputs equal the plain forward, the bytes read are the plan's,
the pack's host bytes stay within the budget, a budget too small is refused exactly, and a file
that changes under a running model is an error naming it, never wrong output."""
from __future__ import annotations

import errno
import json
import gc
import os

import pytest
import torch

from test_executor import budget_for, ids
from test_file_backed import _fresh_ledger, mapped, sim_budget
from test_sim_cuda import cuda_engine, sim  # noqa: F401
from toys import TransformerStack, seeded
from vramcut_core import Engine, EngineConfig, gib_text, gib_to_bytes
from vramcut_core.planning.plan import PlanUnit, build_plan
from vramcut_core.runtime import disk, host_memory as hm
from vramcut_core.planning.report import tiers_text
from vramcut_core.planning.tiers import DEVICE, DISK, RAM, HostUnit, RamBudgetError, choose


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(disk.CACHE_ENV, str(tmp_path / "cache"))


def cpu_engine(model, ram, d=64, **kw):
    budget = budget_for(seeded(TransformerStack(d=d)), ids())
    return Engine(model, EngineConfig(budget_bytes=budget, device="cpu", ram_budget_bytes=ram, **kw))


def reference(d=64):
    with torch.no_grad():
        return seeded(TransformerStack(d=d))(ids())


def run(eng, model, n=2):
    with torch.no_grad():
        return [eng.run(model, ids()) for _ in range(n)]


# -- the choice ------------------------------------------------------------------------------

def _plan(sizes, budget, resident=0):
    units = [PlanUnit(f"u{i}", w, 0, 0, keep_resident=i < resident) for i, w in enumerate(sizes)]
    return build_plan(units, budget)


def test_every_streamed_unit_on_disk_at_the_smallest_budget_and_in_ram_at_a_large_one():
    mib = 1 << 20
    plan = _plan([300 * mib] * 6, 1000 * mib, resident=1)
    host = {u.name: HostUnit(u.weight_bytes, u.weight_bytes) for u in plan.units}
    t = choose(plan, host, 128 * mib, 128 * mib)
    assert t.of("u0") == DEVICE and all(t.of(f"u{i}") == DISK for i in range(1, 6))
    assert t.disk_bytes_per_call == sum(host[n].read_bytes for n in t.disk_units if n in plan.streamed_order)
    assert t.resident_disk_bytes == 300 * mib and t.host_bytes == 128 * mib
    big = choose(plan, host, 128 * mib + 5 * 300 * mib, 128 * mib)
    assert [big.of(f"u{i}") for i in range(1, 6)] == [RAM] * 5 and big.disk_bytes_per_call == 0
    assert big.bounce_bytes == 128 * mib, "the resident unit is still read once from its file"
    mid = choose(plan, host, 128 * mib + 2 * 300 * mib + 1, 128 * mib)
    assert sum(1 for _, k in mid.tier if k == RAM) == 2 and mid.host_bytes <= mid.ram_budget_bytes
    assert "read from disk" in tiers_text(mid)


@pytest.mark.parametrize("need_mib", [1, 333, 4097])
def test_the_refusal_names_the_smallest_budget_and_it_runs_exactly(need_mib):
    """Weights that cannot be read from a file (and the bounce buffer) must fit: the named
    ``max_ram_gb`` plans, 0.001 GiB less is refused."""
    mib = 1 << 20
    plan = _plan([need_mib * mib // 3 + 7, 64 * mib, 64 * mib], 1 << 40)
    host = {u.name: HostUnit(u.weight_bytes, u.weight_bytes, fileable=u.name == "u1") for u in plan.units}
    need = host["u0"].ram_bytes + host["u2"].ram_bytes + 2 * mib
    with pytest.raises(RamBudgetError) as e:
        choose(plan, host, need - 1, 2 * mib)
    named = e.value.min_budget_gb
    assert f"the smallest max_ram_gb that works is {named}" in str(e.value)
    assert choose(plan, host, gib_to_bytes(named), 2 * mib).host_bytes <= gib_to_bytes(named)
    less = f"{float(named) - 0.001:.3f}"
    if float(less) > 0:
        with pytest.raises(RamBudgetError):
            choose(plan, host, gib_to_bytes(less), 2 * mib)


# -- the CPU engine: reads straight into the slot --------------------------------------------

def test_mapped_weights_are_read_from_the_checkpoint_each_call(tmp_path):
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    ref = reference()
    eng = cpu_engine(model, 40_000)
    outs = run(eng, model, 3)
    plan, t = eng.last_plan, eng.last_plan.tiers
    assert all(torch.equal(o, ref) for o in outs)
    assert t.disk_units and t.disk_bytes_per_call > 0
    assert eng.last_stats.disk_bytes_read == t.disk_bytes_per_call, "the bytes read are the plan's"
    assert eng.executor.masters.tiers.files() == [str(tmp_path / "model.safetensors")], "no cache file"
    assert eng.executor.masters.tiers.host_bytes() <= t.ram_budget_bytes
    assert t.ram_bytes == sum(eng.executor.memory.layout(n).nbytes for n in t.in_ram)
    assert set(t.in_ram) <= set(plan.streamed_order)
    for n in t.disk_units:  # their tensors still live in the file's mapping
        u = eng.planner.unit(n)
        assert all(hm.file_backed([ut.tensor for ut in u.tensors]))


def test_resident_units_kept_in_ram_where_the_budget_allows_are_not_read_again_by_calls_outside_a_session(tmp_path):
    # calls outside a session release the device buffers after each call: the resident units are
    # copied again by the next. With room in the RAM budget their host copies are kept in RAM
    # (``Tiers.held``): no call reads them from the file again; without room they are read again
    from vramcut_core.planning.timeline import load_seconds

    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    ref = reference()
    budget = int(budget_for(seeded(TransformerStack(d=64)), ids()) * 1.5)
    roomy = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", ram_budget_bytes=10 ** 8))
    outs = run(roomy, model, 3)
    plan, t = roomy.last_plan, roomy.last_plan.tiers
    assert all(torch.equal(o, ref) for o in outs) and plan.resident_units
    assert roomy.last_stats.disk_bytes_read == 0, "the third call outside a session read nothing"
    assert t.held == plan.resident_units and t.resident_disk_bytes == 0
    assert t.held_bytes == sum(roomy.executor.memory.layout(n).nbytes for n in t.held)
    assert roomy.executor.masters.tiers.host_bytes() == t.ram_bytes <= t.ram_budget_bytes
    assert f"{len(t.held)} blocks on the device kept in RAM too" in tiers_text(t)
    tight = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", ram_budget_bytes=40_000))
    outs = run(tight, model, 3)
    t2 = tight.last_plan.tiers
    assert all(torch.equal(o, ref) for o in outs) and t2.held == ()
    assert tight.last_stats.disk_bytes_read == t2.disk_bytes_per_call + t2.resident_disk_bytes
    # the model: a call that begins with nothing on the device waits for the residents' reads
    reads = {n: tight.executor.masters.tiers.host_unit(n).read_bytes for n in plan.resident_units}
    assert load_seconds(plan, 1e9, 0.0, reads, 1e8) == pytest.approx(
        load_seconds(plan, 1e9) + t2.resident_disk_bytes / 1e8)


def test_weights_in_anonymous_memory_go_to_a_cache_file_written_once_and_removed_with_the_model(tmp_path):
    model = seeded(TransformerStack(d=64))
    eng = cpu_engine(model, 40_000)
    outs = run(eng, model, 3)
    assert all(torch.equal(o, reference()) for o in outs)
    files = eng.executor.masters.tiers.files()
    assert len(files) == 1 and os.path.dirname(files[0]) == disk.cache_dir()
    size = os.path.getsize(files[0])
    assert size == eng.executor.masters.tiers.cache_bytes > 0
    run(eng, model, 1)
    assert os.path.getsize(files[0]) == size, "written once"
    for n in eng.last_plan.tiers.disk_units:
        assert all(hm.file_backed([ut.tensor for ut in eng.planner.unit(n).tensors])), "the RAM copy left"
    del eng, model, outs  # (the measured forward's output holds its meter, and so the engine)
    gc.collect()
    assert not os.path.exists(files[0])


def test_cache_files_of_processes_gone_are_removed(tmp_path):
    os.makedirs(disk.cache_dir())
    stale = os.path.join(disk.cache_dir(), "999999999-1-1.bin")
    open(stale, "wb").write(b"x" * 100)
    c = disk.CacheFile()
    assert not os.path.exists(stale) and os.path.exists(c.path)


def test_a_weight_written_in_place_is_read_from_a_fresh_cache_never_the_stale_file(tmp_path):
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    eng = cpu_engine(model, 40_000)
    run(eng, model, 1)
    name = eng.last_plan.tiers.disk_units[1]
    w = eng.planner.unit(name).tensors[0].tensor
    with torch.no_grad():
        w.mul_(0.5)   # a host's in-place patch: the checkpoint no longer holds these bytes
        want = model(ids())
    out = run(eng, model, 1)[0]
    assert torch.equal(out, want)
    assert any(os.path.dirname(f) == disk.cache_dir() for f in eng.executor.masters.tiers.files())


# -- faults ----------------------------------------------------------------------------------

def _fails_naming(eng, model, path, words):
    with pytest.raises(disk.DiskTierError) as e:
        run(eng, model, 1)
    assert path in str(e.value) and words in str(e.value)


def test_a_removed_file_is_an_error_naming_it_and_the_model_runs_once_it_is_back(tmp_path):
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    eng = cpu_engine(model, 40_000)
    run(eng, model, 1)
    path = str(tmp_path / "model.safetensors")
    os.rename(path, path + ".away")
    _fails_naming(eng, model, path, "was removed")
    os.rename(path + ".away", path)
    assert torch.equal(run(eng, model, 1)[0], reference())


def test_a_truncated_or_modified_file_is_an_error_and_the_restored_file_runs(tmp_path):
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    eng = cpu_engine(model, 40_000)
    run(eng, model, 1)
    path = str(tmp_path / "model.safetensors")
    st = os.stat(path)
    data = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.truncate(len(data) // 2)
    _fails_naming(eng, model, path, "changed size")
    with open(path, "r+b") as f:
        f.write(data)
    _fails_naming(eng, model, path, "was modified")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # back as it was
    assert torch.equal(run(eng, model, 1)[0], reference())


@pytest.mark.parametrize("fault", ["eio", "short"])
def test_a_failed_or_short_read_is_an_error_naming_the_file(tmp_path, monkeypatch, fault):
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    eng = cpu_engine(model, 40_000)
    run(eng, model, 1)
    real = os.preadv

    def broken(fd, bufs, off):
        if fault == "eio":
            raise OSError(errno.EIO, "Input/output error")
        return 0

    monkeypatch.setattr(os, "preadv", broken)
    _fails_naming(eng, model, str(tmp_path / "model.safetensors"),
                  "Input/output error" if fault == "eio" else "came back short")
    monkeypatch.setattr(os, "preadv", real)
    assert torch.equal(run(eng, model, 1)[0], reference())


# -- the simulated accelerator: through the bounce buffer -------------------------------------

def _sim_mapped(sim, monkeypatch, tmp_path, ram, **kw):
    """A model mapped from its checkpoint on the simulated accelerator, its reference output, and
    an engine under the RAM budget ``ram`` (``kw``: more of cuda_engine's settings)."""
    with sim.host_memory():
        model = mapped(lambda: TransformerStack(d=64), tmp_path)
        ref = reference()
    budget = sim_budget(sim, lambda: TransformerStack(d=64), ids())
    _fresh_ledger(monkeypatch)
    return model, ref, cuda_engine(model, budget, ram_budget_bytes=ram, **kw)


def _sim_run(sim, monkeypatch, tmp_path, ram, forwards=3):
    model, ref, eng = _sim_mapped(sim, monkeypatch, tmp_path, ram)
    syncs, waits, outs = [], [], []
    real_take = hm.BounceBuffer.take

    def take(self):
        waits[-1] += any(not ev.query() for ev in self._pieces[self._next].readers.values())
        return real_take(self)

    monkeypatch.setattr(hm.BounceBuffer, "take", take)
    with torch.no_grad(), eng.session():
        for _ in range(forwards):
            s0 = sim.host_syncs
            waits.append(0)
            outs.append(eng.run(model, ids()))
            syncs.append(sim.host_syncs - s0)
    return eng, outs, ref, syncs, waits


def test_sim_disk_units_pass_through_the_page_locked_bounce_buffer(sim, monkeypatch, tmp_path):
    monkeypatch.setattr(hm, "BOUNCE_PIECE", 4096)   # many pieces per unit
    eng, outs, ref, syncs, waits = _sim_run(sim, monkeypatch, tmp_path, 100_000)
    t = eng.last_plan.tiers
    assert t.disk_units and t.bounce_bytes == 2 * 4096
    assert all(torch.equal(o, ref) for o in outs)
    assert eng.last_stats.disk_bytes_read == t.disk_bytes_per_call
    bounce = hm._BOUNCE()
    assert all(b.data_ptr() in sim.registered for b in bounce.bufs) and not sim.pageable_async
    assert hm.PAGE_LOCKED.bytes == bounce.nbytes + sum(
        m.buf.numel() for m in eng.executor.masters.masters.values() if m.page_locked)
    assert eng.executor.masters.tiers.host_bytes() <= t.ram_budget_bytes
    # a steady call waits on the host only for a bounce piece whose copy has not landed
    assert syncs[-1] <= waits[-1], (syncs, waits)


def test_sim_catches_a_bounce_piece_read_into_before_its_copy(sim, monkeypatch, tmp_path):
    """Without the wait in ``BounceBuffer.take`` the reader fills a piece whose copy has not run
    yet: the device receives the next piece's bytes."""
    def take_without_waiting(self):
        k = self._next
        self._next = (k + 1) % len(self.bufs)
        return self.bufs[k], k

    monkeypatch.setattr(hm, "BOUNCE_PIECE", 4096)
    monkeypatch.setattr(hm.BounceBuffer, "take", take_without_waiting)
    model, ref, eng = _sim_mapped(sim, monkeypatch, tmp_path, 100_000)
    with torch.no_grad():
        out = eng.run(model, ids())
    assert not torch.equal(out, ref), "the copies read pieces already refilled"
    del eng
    gc.collect()
    sim.hazards.clear()


def test_sim_a_ram_budget_below_one_call_is_refused_before_anything_moves(sim, monkeypatch, tmp_path):
    monkeypatch.setattr(hm, "BOUNCE_PIECE", 3 << 20)
    with sim.host_memory():
        model = mapped(lambda: TransformerStack(d=256), tmp_path)
    budget = sim_budget(sim, lambda: TransformerStack(d=256), ids())
    _fresh_ledger(monkeypatch)
    with pytest.raises(RamBudgetError) as e:
        with torch.no_grad():
            cuda_engine(model, budget, ram_budget_bytes=1 << 20).run(model, ids())
    named = e.value.min_budget_gb
    assert hm._BOUNCE is None and not hm.PAGE_LOCKED.bytes, "nothing was page-locked"
    with torch.no_grad():
        cuda_engine(model, budget, ram_budget_bytes=gib_to_bytes(named)).run(model, ids())
        with pytest.raises(RamBudgetError):
            cuda_engine(model, budget, ram_budget_bytes=gib_to_bytes(f"{float(named) - 0.001:.3f}")).run(model, ids())
    assert gib_text(e.value.min_budget_bytes) == named


def test_sim_without_page_locking_disk_pieces_are_copied_synchronously(sim, monkeypatch, tmp_path):
    monkeypatch.setattr(hm, "BOUNCE_PIECE", 4096)
    model, ref, eng = _sim_mapped(sim, monkeypatch, tmp_path, 100_000, pin_memory=False)
    with torch.no_grad():
        outs = [eng.run(model, ids()) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    assert hm._BOUNCE is None and not hm.PAGE_LOCKED.bytes and not sim.pageable_async
    assert eng.last_stats.disk_bytes_read == eng.last_plan.tiers.disk_bytes_per_call > 0


# -- the command line --------------------------------------------------------------------------

def test_plan_cli_prints_the_tiers_under_a_ram_budget(tmp_path, capsys):
    from test_cli import flux_like_entries, run_cli, write_header_only
    from vramcut_core.cli.commands import main

    path = tmp_path / "flux_like.safetensors"
    total = write_header_only(path, flux_like_entries(dtype="F32"))   # 24 GiB
    assert main(["plan", str(path), "--max-vram", "12", "--max-ram", "8", "--disk-gbps", "3.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["tiers"]
    assert t["ram_budget_bytes"] == 8 << 30 and t["host_bytes"] <= 8 << 30
    assert t["units"]["ram"] and t["units"]["disk"] and t["bounce_bytes"] == 2 * hm.BOUNCE_PIECE
    assert t["ram_bytes"] + t["disk_bytes"] == total
    assert t["disk_s_per_call"] == pytest.approx(t["disk_bytes_per_call"] / 3.5e9)
    assert main(["plan", str(path), "--max-vram", "12", "--max-ram", "8", "--disk-gbps", "3.5"]) == 0
    text = capsys.readouterr().out
    assert "host tiers under 8.000 GiB RAM" in text and "read from disk" in text and "at 3.50 GB/s" in text
    assert main(["plan", str(path), "--max-vram", "12", "--max-ram", "64"]) == 0
    assert "0 read from disk" in capsys.readouterr().out
    rc, err = run_cli(["plan", str(path), "--max-vram", "12", "--max-ram", "0.1"], capsys)
    assert rc == 2 and "the smallest max_ram_gb that works is 0.125" in err and len(err.strip().splitlines()) == 1


# -- what the load cost (the node's load line) ------------------------------------------------

def test_the_load_cost_is_measured_the_host_copy_written_once_and_its_ram_released(tmp_path):
    """Weights the host loaded into anonymous memory (two blocks of 128 MiB: allocations that big
    are mapped and returned whole when freed): the move under the RAM budget writes them to the
    cache file (``cached_bytes``, its time), and the process's anonymous memory falls by about
    as much (``released_bytes``, measured); nothing is mapped from a checkpoint. Before the first
    call nothing has moved and nothing is said."""
    model = seeded(TransformerStack(d=2048, depth=2))
    with torch.no_grad():
        ref = model(ids())
    eng = Engine(model, EngineConfig(budget_bytes=budget_for(model, ids()), device="cpu", ram_budget_bytes=1 << 20))
    assert "load" not in eng.describe()["plan"]["tiers"], "nothing moved before a call"
    with torch.no_grad():
        assert torch.equal(eng.run(model, ids()), ref)
    load = eng.describe()["plan"]["tiers"]["load"]
    big = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    assert load["mapped_bytes"] == 0 and load["cached_bytes"] >= big
    assert load["cache_file_bytes"] == eng.executor.masters.tiers.cache_bytes >= load["cached_bytes"]
    assert 0 < load["write_s"] <= load["move_s"]
    assert load["released_bytes"] is not None and load["released_bytes"] >= 0
    assert load["ram_bytes"] == eng.executor.masters.tiers.host_bytes() and load["page_locked_bytes"] == 0


RELEASED_PY = """
import sys, torch
from test_executor import budget_for, ids
from toys import TransformerStack, seeded
from vramcut_core import Engine, EngineConfig
model = seeded(TransformerStack(d=2048, depth=2))
with torch.no_grad():
    ref = model(ids())
eng = Engine(model, EngineConfig(budget_bytes=budget_for(model, ids()), device="cpu", ram_budget_bytes=1 << 20))
with torch.no_grad():
    assert torch.equal(eng.run(model, ids()), ref)
big = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
print(eng.describe()["plan"]["tiers"]["load"]["released_bytes"], big)
"""


def test_the_ram_the_host_load_held_is_measured_released_in_a_fresh_process():
    """The fall of the process's anonymous memory once the two 128 MiB blocks left RAM, measured in
    an interpreter of its own: in a long-lived process (the whole suite) earlier tests' memory
    makes the fall unreadable (it read 0 there)."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))]))
    out = subprocess.run([sys.executable, "-c", RELEASED_PY], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    released, big = map(int, out.stdout.split()[-2:])
    assert released >= 0.8 * big, (released, big)


def test_the_load_cost_of_mapped_weights_is_what_the_checkpoint_holds(tmp_path):
    """Weights mapped from their checkpoint: the disk-tier blocks are read from it (``mapped_bytes``
    their bytes), nothing written to a cache file."""
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    eng = cpu_engine(model, 40_000)
    run(eng, model, 2)
    t, load = eng.last_plan.tiers, eng.describe()["plan"]["tiers"]["load"]
    reads = eng.executor.masters.tiers
    assert load["cached_bytes"] == load["cache_file_bytes"] == 0 and load["write_s"] == 0
    assert load["mapped_bytes"] == sum(reads.host_unit(n).read_bytes for n, k in t.tier if k != RAM) > 0
    assert load["ram_bytes"] == t.ram_bytes


@pytest.mark.parametrize("where", ["anonymous", "mapped"])
def test_inference_tensors_as_the_host_loads_a_vae_run_under_a_ram_budget(tmp_path, where):
    """Weights that are inference tensors (a host that loads under inference mode, as ComfyUI's
    VAE loader does, from a mapped checkpoint or into RAM) keep no version counter: the tiers
    run them all the same."""
    with torch.inference_mode():
        model = mapped(lambda: TransformerStack(d=64), tmp_path) if where == "mapped" else seeded(TransformerStack(d=64))
        if where == "anonymous":
            for p in model.parameters():
                p.data = p.data.clone()
    assert next(model.parameters()).is_inference()
    eng = cpu_engine(model, 40_000)
    with torch.inference_mode():
        outs = [eng.run(model, ids()) for _ in range(2)]
    assert all(torch.equal(o, reference()) for o in outs)
    assert eng.last_plan.tiers.disk_units and eng.last_stats.disk_bytes_read == eng.last_plan.tiers.disk_bytes_per_call
