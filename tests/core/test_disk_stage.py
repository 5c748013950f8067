"""The disk read stage (issue 40): a disk-tier group's read is a stage before its copy, issued
when its slot frees and run on the reader thread beside the compute of the groups before it; the
group's entry waits for it. Shown by order, not by time: each read waits until a unit computes
after it was issued, which a host that waited for the read before computing would never do."""
from __future__ import annotations

import threading

import torch

from test_tiers import _cache_dir, _sim_mapped, cpu_engine, reference  # noqa: F401 (the cache dir fixture)
from test_sim_cuda import sim  # noqa: F401 (the simulated accelerator fixture)
from test_file_backed import mapped
from test_executor import ids
from toys import TransformerStack
from vramcut_core.runtime import disk


class ReadGate:
    """Holds each disk read until a unit of ``model`` has computed after the host issued it (or
    2 s passed: a host blocked on this read computes nothing meanwhile), and logs (thread, whether
    it overlapped). Counted from the read's issue, not from when the reader thread begins it: one
    read queued behind another may begin after the compute that hid it, on a loaded machine. A
    read issued before ``on()`` (for the call after the last one) is not held nor logged."""

    def __init__(self, model, monkeypatch) -> None:
        self.computed = [0]  # compute ends seen (forward hooks on every leaf module, the host thread)
        for m in model.modules():
            if not list(m.children()):
                m.register_forward_hook(lambda *_a: self.computed.__setitem__(0, self.computed[0] + 1))
        self.log: list[tuple[str, bool]] = []
        self.monkeypatch, self.real, self.issued = monkeypatch, disk.read_into, threading.local()

    def read_into(self, dest, reads):
        seen = getattr(self.issued, "seen", None)
        if seen is not None:
            lock, overlapped = threading.Event(), False
            for _ in range(400):
                if self.computed[0] > seen:
                    overlapped = True
                    break
                lock.wait(0.005)
            self.log.append((threading.current_thread().name, overlapped))
        return self.real(dest, reads)

    def on(self) -> None:
        gate, pool = self, disk.reader()

        class IssuedAt:
            """The reader thread, each job told the compute count when the host issued it."""

            def submit(self, fn, *args):
                seen = gate.computed[0]

                def job():
                    gate.issued.seen = seen
                    try:
                        return fn(*args)
                    finally:
                        gate.issued.seen = None
                return pool.submit(job)

        issued_at = IssuedAt()
        self.monkeypatch.setattr(disk, "reader", lambda: issued_at)
        self.monkeypatch.setattr(disk, "read_into", self.read_into)

    def overlapped(self) -> list[bool]:
        """Whether each read but the last overlapped compute: the last read is for a call that
        never comes, and whether units of its call computed after it was issued depends on where
        in the call its slot freed, so it is not asked."""
        assert len(self.log) >= 2 and all(name.startswith("vramcut-disk") for name, _ in self.log), \
            ("on the reader thread", self.log)
        return [ok for _, ok in self.log[:-1]]


def test_cpu_a_disk_group_is_read_while_the_groups_before_it_compute(tmp_path, monkeypatch):
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    ref = reference()
    eng = cpu_engine(model, 40_000)
    gate = ReadGate(model, monkeypatch)
    with torch.no_grad(), eng.session():
        for _ in range(2):  # the plan is made and measured; the session's slots are kept
            assert torch.equal(eng.run(model, ids()), ref)
        plan = eng.last_plan
        disk_groups = [g for g in plan.streamed_groups if any(n in plan.tiers.disk_units for n in g)]
        assert plan.slots == 2 and len(disk_groups) >= 3
        gate.on()
        outs = [eng.run(model, ids()) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs), "exact output"
    assert eng.last_stats.disk_bytes_read == plan.tiers.disk_bytes_per_call, "the bytes read are the plan's"
    # every read of a steady call overlaps compute: its group's read was issued before the units
    # ahead of it were done (the next call's first group: read while the next call's first units run)
    assert gate.overlapped() == [True] * (len(gate.log) - 1), gate.log


# -- the timeline's reader lane and the choice by time -----------------------------------------

def test_the_reader_lane_hides_reads_shorter_than_the_compute_before_them_and_serialises_the_rest():
    from vramcut_core.planning.timeline import Step, simulate

    # three streamed groups, two slots, CPU (the read fills the slot; nothing else is copied):
    # the read of a group is issued when the group two places before it is done, so a read of 1 s
    # runs beside 2 s of compute: the step is the compute alone
    hidden = simulate([Step(2, 0.0, read_s=1.0)] * 3, depth=1, overlap=False)
    assert hidden.step_s == 6 and hidden.stall_s == 0
    # reads of 3 s: the one reader runs them one after another, so a call takes three reads
    lane = simulate([Step(2, 0.0, read_s=3.0)] * 3, depth=1, overlap=False)
    assert abs(lane.step_s - 9) < 1e-9 and abs(lane.stall_s - 3) < 1e-9
    # the copy engine fed by the reader (CUDA): the copy waits for the read, the group for both
    fed = simulate([Step(2, 0.5, read_s=1.0)] * 3, depth=1, overlap=True)
    assert fed.step_s == 6
    # a group read when entered (looped) waits for its read whole
    assert simulate([Step(2, 0.0, read_s=1.0, sync=True)] * 3, depth=1, overlap=False).step_s == 9


def _timed_plan(computes, mib=100):
    from vramcut_core.planning.plan import PlanUnit, build_plan
    units = [PlanUnit(f"u{i}", mib << 20, 0, 0, compute_s=c) for i, c in enumerate(computes)]
    return build_plan(units, 2 * (mib << 20) + 1)


def test_ram_goes_to_the_units_whose_reads_compute_cannot_hide():
    from vramcut_core.planning import timeline
    from vramcut_core.planning.tiers import DISK, RAM, HostUnit, choose

    # a read of 100 MiB takes about 0.1 s: behind a 1 s unit it is hidden, behind 0.01 s it is not
    plan = _timed_plan([1.0, 1.0, 0.01, 0.01, 1.0, 1.0])
    assert plan.slots == 2 and not plan.resident_units
    host = {u.name: HostUnit(u.weight_bytes, u.weight_bytes) for u in plan.units}

    def step_of(reads):
        return timeline.predict(plan, 1e10, overlap=False, reads=reads, disk_bytes_per_s=1e9).step_s

    roomy = 10 * (100 << 20)  # room for every unit
    by_bytes = choose(plan, host, roomy, 0, 1e9)
    by_time = choose(plan, host, roomy, 0, 1e9, step_of)
    assert len(by_bytes.in_ram) == 6, "without the timeline every unit that fits goes to RAM"
    assert 0 < len(by_time.in_ram) < 6 and by_time.disk_units, (by_time.in_ram, by_time.disk_units)
    # as fast as with every unit in RAM (on CPU faster: a read fills the slot on the reader
    # thread, a copy from RAM is the host's own time), with less RAM
    assert by_time.predicted_step_s <= step_of({}) + 1e-9
    assert by_time.predicted_step_s < step_of({n: 100 << 20 for n in host}), "RAM where reads were not hidden"
    assert by_time.ram_bytes < by_bytes.ram_bytes
    # each unit left on disk is one the compute hides: taking it to RAM would not be faster
    for n in by_time.disk_units:
        rest = {k: 100 << 20 for k in by_time.disk_units if k != n}
        assert step_of(rest) >= by_time.predicted_step_s - 1e-9
    assert {by_time.of(n) for n in ("u0", "u1", "u2", "u3", "u4", "u5")} <= {RAM, DISK}


def test_the_cpu_engine_chooses_its_tiers_by_the_timeline_and_says_the_step_with_reads(tmp_path, monkeypatch):
    from vramcut_core.figures import bandwidth
    from vramcut_core.planning import timeline
    from vramcut_core.planning.tiers import tiers_to_json

    rate = 1e8
    monkeypatch.setattr(bandwidth, "disk_read", lambda path: {"cold_bytes_per_s": rate, "cached_bytes_per_s": rate,
                                                              "device": None, "source": "test"})
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    ref = reference()
    eng = cpu_engine(model, 40_000, speed="time", flops_per_s=1e9, bandwidth_bytes_per_s=5e9)
    with torch.no_grad(), eng.session():  # the last: a steady call of the timed plan
        outs = [eng.run(model, ids()) for _ in range(4)]
    assert all(torch.equal(o, ref) for o in outs)
    plan, t = eng.last_plan, eng.last_plan.tiers
    assert plan.time is not None and t.disk_units and t.predicted_step_s is not None
    host = eng.executor.masters.tiers
    reads = {n: host.host_unit(n).read_bytes for n in t.disk_units}
    assert t.predicted_step_s == timeline.predict(plan, 5e9, overlap=False, reads=reads,
                                                  disk_bytes_per_s=rate).step_s
    assert tiers_to_json(t, plan)["predicted_step_s"] == t.predicted_step_s
    assert eng.last_stats.disk_bytes_read == t.disk_bytes_per_call


def test_sim_a_failed_read_through_the_bounce_buffer_names_the_file_and_it_runs_again(sim, monkeypatch, tmp_path):
    import errno
    import os

    import pytest

    from vramcut_core.runtime import host_memory as hm

    monkeypatch.setattr(hm, "BOUNCE_PIECE", 4096)  # several pieces per unit: reads in flight when one fails
    model, ref, eng = _sim_mapped(sim, monkeypatch, tmp_path, 100_000)
    with torch.no_grad():
        assert torch.equal(eng.run(model, ids()), ref)
    real = os.preadv

    def broken(fd, bufs, off):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    with pytest.raises(disk.DiskTierError) as e, torch.no_grad():
        eng.run(model, ids())
    assert str(tmp_path / "model.safetensors") in str(e.value) and "Input/output error" in str(e.value)
    monkeypatch.setattr(os, "preadv", real)
    with torch.no_grad():
        assert torch.equal(eng.run(model, ids()), ref)
    assert eng.last_plan.tiers.disk_units


def test_a_reopened_weights_file_closes_its_old_descriptor_after_the_reads_issued_before(tmp_path, monkeypatch):
    import os

    import pytest

    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 8192)
    f = disk.WeightFile(str(path))
    old = f.fd
    gate = threading.Event()
    disk.reader().submit(gate.wait, 10)  # a read issued ahead, still in flight on the reader
    real = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: real(0 if fd == old else fd))  # the descriptor is not the file's now
    f.check()  # the file is as it was: opened again
    monkeypatch.setattr(os, "fstat", real)
    assert f.fd != old
    os.fstat(old)  # still open while the reads before it run: its number cannot be reused under them
    gate.set()
    disk.reader().submit(lambda: None).result()
    with pytest.raises(OSError):
        os.fstat(old)


def test_sim_a_steady_call_reading_from_disk_waits_on_the_host_for_nothing(sim, monkeypatch, tmp_path):
    """CUDA read-ahead: every unit on disk, so every group's reads and copies are issued on the
    reader thread when its slot frees; the reader waits for the slot's free event and for each
    bounce piece's last copy, the host for a group's reads only where it is entered (a join, no
    device synchronisation): a steady call's host syncs do not grow with its reads (none here; with
    the reads made by the host, each piece's refill waited on the host)."""
    import pytest

    from test_sim_cuda import cuda_engine
    from vramcut_core.planning.tiers import RamBudgetError

    model, ref, eng = _sim_mapped(sim, monkeypatch, tmp_path, 1)
    with pytest.raises(RamBudgetError) as e, torch.no_grad():
        eng.run(model, ids())
    syncs = {}
    for ram in (e.value.min_budget_bytes, 1 << 30):  # every unit on disk; every unit in RAM
        eng = cuda_engine(model, eng.config.budget_bytes, ram_budget_bytes=ram)
        with torch.no_grad(), eng.session():
            for _ in range(2):
                assert torch.equal(eng.run(model, ids()), ref)
            s0, r0 = sim.host_syncs, sim.reader_syncs
            assert torch.equal(eng.run(model, ids()), ref)
        syncs[ram] = (sim.host_syncs - s0, sim.reader_syncs - r0)
        if ram < 1 << 30:
            plan = eng.last_plan
            assert len(plan.tiers.disk_units) >= 3 and not plan.tiers.in_ram
            assert eng.last_stats.disk_bytes_read == plan.tiers.disk_bytes_per_call
    on_disk, in_ram = syncs[e.value.min_budget_bytes], syncs[1 << 30]
    assert on_disk[0] == in_ram[0] and on_disk[1] > 0 == in_ram[1], syncs


def test_sim_a_disk_group_is_read_while_the_groups_before_it_compute(sim, monkeypatch, tmp_path):
    """CUDA read-ahead, shown by order as on CPU: each disk-tier group's transfer is issued to the
    reader when its slot frees, and its read finishes only once a unit has computed after that
    (or 2 s passed: a host that waited for the read where it issued the copy, as it did before
    the reader issued the copies, computes nothing meanwhile)."""
    import pytest

    from vramcut_core.planning.tiers import RamBudgetError

    from test_sim_cuda import cuda_engine

    model, ref, eng = _sim_mapped(sim, monkeypatch, tmp_path, 1)
    with pytest.raises(RamBudgetError) as e, torch.no_grad():
        eng.run(model, ids())
    eng = cuda_engine(model, eng.config.budget_bytes, ram_budget_bytes=e.value.min_budget_bytes)  # all on disk
    gate = ReadGate(model, monkeypatch)
    with torch.no_grad(), eng.session():
        for _ in range(2):
            assert torch.equal(eng.run(model, ids()), ref)
        gate.on()
        outs = [eng.run(model, ids()) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs), "exact output"
    assert len(gate.log) >= 4 and gate.overlapped() == [True] * (len(gate.log) - 1), gate.log
