"""The plan across devices (vramcut_core.planning.placement) and its command line: one device gives
exactly today's plan; two or four devices hold contiguous runs each within its budget, with the
fewest host-link bytes, then hops; the hop carries the first unit's entry bytes; budgets too small
in total are refused with budgets that work; the devices string is parsed strictly."""
from __future__ import annotations

import json

import pytest

from test_cli import flux_like_entries, write_header_only
from vramcut_core import BudgetError, PlanOptions, PlanUnit, make_plan
from vramcut_core.planning.budget import gib_given_text, gib_text
from vramcut_core.cli.commands import main
from vramcut_core.planning.placement import parse_devices, place

MB = 1 << 20
GIB = 1 << 30


def stack(n=10, w=100, act=True):
    a = (8 * MB, 4 * MB) if act else (None, None)
    u = [PlanUnit("prelude", 50 * MB, *a)]
    u += [PlanUnit(f"blocks.{i}", w * MB, a[0], (a[1] + i * MB) if act else None) for i in range(n)]
    return u + [PlanUnit("final", 20 * MB, *a)]


def mixed():
    return ([PlanUnit("prelude", 30 * MB, 5 * MB, 1 * MB, keep_resident=True)]
            + [PlanUnit(f"double.{i}", 240 * MB, 20 * MB, 6 * MB) for i in range(4)]
            + [PlanUnit(f"single.{i}", 90 * MB, 12 * MB, 6 * MB) for i in range(8)]
            + [PlanUnit("final", 10 * MB, 3 * MB, 2 * MB, entered=False)])


@pytest.mark.parametrize("units, budget, opts", [
    (stack(), 400 * MB, PlanOptions()),
    (stack(act=False), 700 * MB, PlanOptions()),
    (mixed(), 900 * MB, PlanOptions()),
    (mixed(), 700 * MB, PlanOptions(prefetch=False)),
    (stack(), 5 * GIB, PlanOptions()),
], ids=["stack", "weights_only", "mixed", "no_prefetch", "all_resident"])
def test_one_device_is_exactly_todays_plan(units, budget, opts):
    p = place(units, [("cuda:0", budget)], opts)
    assert len(p.devices) == 1 and p.hops == ()
    assert p.devices[0].plan == make_plan(units, budget, opts)


def test_two_devices_hold_what_one_streams_with_one_hop():
    units = stack()  # 1070 MiB of weights
    one = make_plan(units, 600 * MB)
    assert one.streamed_bytes_per_forward > 0
    p = place(units, [("cuda:0", 600 * MB), ("cuda:1", 600 * MB)])
    assert p.host_bytes_per_forward == 0 and len(p.hops) == 1
    d0, d1 = p.devices
    assert (d0.first, d0.stop, d1.first, d1.stop) == (0, d0.stop, d0.stop, len(units))
    for d in p.devices:
        assert d.plan.peak_bytes <= d.budget_bytes
        assert [u.name for u in d.plan.units] == [u.name for u in units[d.first:d.stop]]
    (hop,) = p.hops
    assert hop.bytes == units[d1.first].entry_bytes and hop.unit == units[d1.first].name
    assert p.hop_bytes_known


def test_a_device_that_is_not_needed_gets_nothing_and_no_hop():
    units = stack()
    p = place(units, [("cuda:0", 4 * GIB), ("cuda:1", 4 * GIB)])
    assert p.hops == () and p.devices[1].plan is None and p.host_bytes_per_forward == 0


def test_what_fits_nowhere_streams_to_the_device_that_computes_it():
    units = stack(n=16)  # 1670 MiB over 4 x 300 MiB
    devs = [(f"cuda:{i}", 300 * MB) for i in range(4)]
    p = place(units, devs)
    assert all(d.plan is None or d.plan.peak_bytes <= d.budget_bytes for d in p.devices)
    assert 0 < p.host_bytes_per_forward < make_plan(units, 300 * MB).streamed_bytes_per_forward
    # the fewest hops at that: no placement with the same host bytes has fewer
    assert len(p.hops) <= len(p.used) - 1


def test_unmeasured_activations_are_said_to_be_unknown_at_the_hop():
    p = place(stack(act=False), [("cuda:0", 600 * MB), ("cuda:1", 600 * MB)])
    assert len(p.hops) == 1 and p.hops[0].bytes == 0 and not p.hop_bytes_known


def test_budgets_too_small_in_total_are_refused_with_budgets_that_work():
    units = stack()
    devs = [("cuda:0", 100 * MB), ("cuda:1", 50 * MB)]
    with pytest.raises(BudgetError) as e:
        place(units, devs)
    msg = str(e.value)
    assert "cuda:0=" in msg and "cuda:1=" in msg and e.value.min_budget_bytes > 150 * MB
    # its own words: the budgets given (rounded down: never read as the smallest), and per device
    # and in all the smallest that work (GiB as the Devices node takes them); no unit named "devices"
    (d0, b0), (d1, b1) = e.value.device_budgets
    assert msg.startswith(f"VRAM budgets cuda:0={gib_given_text(100 * MB)}, cuda:1={gib_given_text(50 * MB)} (")
    assert f"are cuda:0={gib_text(b0)}, cuda:1={gib_text(b1)} (" in msg and "GiB in all)" in msg
    assert "unit 'devices'" not in msg and e.value.min_budget_bytes == b0 + b1
    assert place(units, list(e.value.device_budgets))  # the suggestion places
    # the suggestion (same proportions, 2:1) fits
    total = e.value.min_budget_bytes
    p = place(units, [("cuda:0", total * 2 // 3 + 2), ("cuda:1", total // 3 + 2)])
    assert all(d.plan is None or d.plan.peak_bytes <= d.budget_bytes for d in p.devices)


def test_parse_devices_reads_gib_per_device():
    assert parse_devices("cuda:0=8, cuda:1=6.5") == [("cuda:0", 8 * GIB), ("cuda:1", int(6.5 * GIB))]
    assert parse_devices("cuda:0=free", free=True) == [("cuda:0", None)]


@pytest.mark.parametrize("text, words", [
    ("", "empty"), ("cuda:0", "DEVICE=GIB"), ("gpu0=8", "unknown device"), ("cuda:0=-2", "positive"),
    ("cuda:0=abc", "positive"), ("cuda:0=0", "positive"), ("cuda:0=8,cuda:0=4", "twice"),
    ("cuda:0=free", "free memory"), ("cuda:x=8", "unknown device"),
])
def test_parse_devices_rejects_malformed_input_with_the_entry_at_fault(text, words):
    with pytest.raises(ValueError, match=words):
        parse_devices(text)


def test_parse_devices_rejects_a_device_the_host_cannot_see():
    with pytest.raises(ValueError, match="cuda:3 is not a device this host can see"):
        parse_devices("cuda:0=8,cuda:3=8", known=lambda d: d != "cuda:3")


def test_cli_places_a_header_across_devices(tmp_path, capsys):
    path = tmp_path / "flux_like.safetensors"
    total = write_header_only(path, flux_like_entries(dtype="BF16"))  # about 12 GiB
    rc = main(["plan", str(path), "--devices", "cuda:0=8,cuda:1=8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["host_bytes_per_forward"] == 0 and len(out["hops"]) == 1
    assert [d["device"] for d in out["devices"]] == ["cuda:0", "cuda:1"]
    assert sum(u["weight_bytes"] for d in out["devices"] for u in d["plan"]["units"]) == total
    assert all(d["plan"]["peak_bytes"] <= d["budget_bytes"] for d in out["devices"])
    rc = main(["plan", str(path), "--devices", "cuda:0=8,cuda:1=8"])
    text = capsys.readouterr().out
    assert rc == 0 and "cuda:0" in text and "cuda:1" in text and "hop cuda:0 -> cuda:1" in text
    assert "hops per call: 1" in text


@pytest.mark.parametrize("args, words", [
    (["--devices", "cuda:0=free"], "free memory"),
    (["--devices", "cuda:0=-1"], "positive"),
    (["--devices", "tpu:0=4"], "unknown device"),
    (["--devices", "cuda:0=8", "--max-vram", "8"], "one of"),
    ([], "one of"),
    (["--devices", "cuda:0=0.001,cuda:1=0.001"], "cuda:0="),
])
def test_cli_devices_errors_are_one_line(tmp_path, capsys, args, words):
    path = tmp_path / "m.safetensors"
    write_header_only(path, flux_like_entries(n_double=3, n_single=3, d=256))
    rc = main(["plan", str(path), *args])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err


def test_equal_bytes_and_hops_are_broken_by_the_predicted_step():
    # cutting after the second or the fourth unit streams the same bytes through one hop of the
    # same bytes; the cut after the second unit predicts the shorter step (summed per device)
    from vramcut_core import build_plan
    from vramcut_core.planning.timeline import predict

    units = [PlanUnit(f"u{i}", (100 if i % 2 == 0 else 200) * MB, 8 * MB, 4 * MB,
                      compute_s=0.001 if i % 2 == 0 else 0.020) for i in range(6)]
    devs = [("cuda:0", 400 * MB), ("cuda:1", 500 * MB)]

    def at(cut):
        a, b = build_plan(units[:cut], devs[0][1]), build_plan(units[cut:], devs[1][1])
        return (a.streamed_bytes_per_forward + b.streamed_bytes_per_forward,
                predict(a, 1e10).step_s + predict(b, 1e10).step_s)

    (bytes2, t2), (bytes4, t4) = at(2), at(4)
    assert bytes2 == bytes4 and t2 < t4
    by_order = place(units, devs)  # without a bandwidth: the most units on the first device
    timed = place(units, devs, bytes_per_s=1e10)
    assert (by_order.devices[0].stop, timed.devices[0].stop) == (4, 2)
    assert timed.host_bytes_per_forward == by_order.host_bytes_per_forward
    assert len(timed.hops) == len(by_order.hops) == 1
