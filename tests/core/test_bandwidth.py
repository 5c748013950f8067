"""The answer line's figures: bandwidth measured once and cached, and what a plan costs."""
import json

import pytest
import torch

from vramcut_core import PlanUnit, RunStats, build_plan, plan_to_json
from vramcut_core.figures import bandwidth
from vramcut_core.planning.report import cost_to_json

MB = 1 << 20


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(bandwidth.CACHE_ENV, str(tmp_path))
    bandwidth.forget()
    yield tmp_path
    bandwidth.forget()


def test_bandwidth_is_measured_once_then_cached(cache_dir):
    first = bandwidth.host_to_device("cpu")
    assert first["source"] == "measured" and first["device"] == "cpu" and first["bytes_per_s"] > 0
    stored = json.loads((cache_dir / bandwidth.CACHE_FILE).read_text())
    assert stored["cpu"]["bytes_per_s"] == pytest.approx(first["bytes_per_s"])
    assert bandwidth.host_to_device("cpu")["source"] == "memory"
    bandwidth.forget()  # a new process: the file answers
    again = bandwidth.host_to_device("cpu")
    assert again["source"] == "cache" and again["bytes_per_s"] == pytest.approx(first["bytes_per_s"])


def test_a_broken_cache_file_means_measuring_again(cache_dir):
    (cache_dir / bandwidth.CACHE_FILE).write_text("{not json")
    assert bandwidth.host_to_device(torch.device("cpu"))["source"] == "measured"
    assert json.loads((cache_dir / bandwidth.CACHE_FILE).read_text())["cpu"]["bytes_per_s"] > 0


def test_measure_is_bytes_over_seconds():
    bps = bandwidth.measure("cpu", nbytes=4 * MB, repeats=2)
    assert 1e6 < bps < 1e13  # between 1 MB/s and 10 TB/s: a rate, not a time or a count


def _plan(budget):
    units = [PlanUnit("prelude", 10 * MB, 5 * MB, 1 * MB)]
    units += [PlanUnit(f"blocks.{i}", 100 * MB, 5 * MB, 1 * MB) for i in range(8)]
    units.append(PlanUnit("final", 10 * MB, 5 * MB, 1 * MB))
    return build_plan(units, budget)


BW = {"bytes_per_s": 10.0 * 1024**3, "device": "cuda:Test GPU", "source": "cache"}


def test_cost_before_a_run_is_an_estimate_from_the_bandwidth():
    plan = _plan(400 * MB)
    pj = plan_to_json(plan)
    c = cost_to_json(pj, BW)
    streamed = [s for s in pj["segments"] if not s["resident"]]
    assert streamed, "the budget must leave something streamed"
    assert c["fits"] is True
    assert c["blocks"] == 10 and c["blocks_streamed"] == sum(len(s["units"]) for s in streamed)
    assert c["added_source"] == "estimate" and c["measured_s_per_forward"] is None
    assert c["added_s_per_forward"] == pytest.approx(plan.streamed_bytes_per_forward / BW["bytes_per_s"])
    assert c["bandwidth_device"] == "cuda:Test GPU"


def test_cost_after_a_run_is_the_measured_wait_per_forward():
    plan = _plan(400 * MB)
    stats = RunStats(forwards=4, time_wait_s=0.8, time_copy_s=1.2, time_compute_s=2.0)
    c = cost_to_json(plan_to_json(plan, stats), BW)
    assert c["added_source"] == "measured" and c["measured_forwards"] == 4
    assert c["added_s_per_forward"] == pytest.approx(0.2)
    assert c["measured_copy_s_per_forward"] == pytest.approx(0.3)
    assert c["estimate_s_per_forward"] == pytest.approx(plan.streamed_bytes_per_forward / BW["bytes_per_s"])


def test_cost_without_a_bandwidth_has_no_time():
    c = cost_to_json(plan_to_json(_plan(400 * MB)), None)
    assert c["added_s_per_forward"] is None and c["added_source"] is None


def test_cost_of_an_all_resident_plan_streams_nothing():
    c = cost_to_json(plan_to_json(_plan(4096 * MB)), BW)
    assert c["blocks_streamed"] == 0 and c["added_s_per_forward"] == 0.0


def test_cost_after_a_run_leaves_the_measuring_forward_out():
    """The measuring forward (every block through one slot, once per shape) is not the plan's
    cost: the time and the bytes come from the forwards that ran the plan, and before any did,
    the cost is the estimate."""
    plan = _plan(400 * MB)
    everything = RunStats(forwards=3, time_wait_s=1.2, bytes_streamed=3 * 400 * MB, copies=20)
    steady = RunStats(forwards=2, time_wait_s=0.2, bytes_streamed=2 * plan.streamed_bytes_per_forward,
                      copies=2 * plan.transfers_per_forward)
    c = cost_to_json(plan_to_json(plan, everything, steady), BW)
    assert c["added_source"] == "measured" and c["measured_forwards"] == 2
    assert c["added_s_per_forward"] == pytest.approx(0.1)
    assert c["measured_bytes_per_forward"] == plan.streamed_bytes_per_forward
    assert c["measured_copies_per_forward"] == plan.transfers_per_forward

    only_measuring = cost_to_json(plan_to_json(plan, everything, RunStats()), BW)
    assert only_measuring["added_source"] == "estimate" and only_measuring["measured_forwards"] == 0


def test_cost_counts_blocks_cut_into_parts_as_their_blocks():
    """The node's words: a block cut finer to fit (the plan's ``split``) still counts as one block,
    its pieces as parts; a plan with nothing cut has no parts."""
    pj = plan_to_json(_plan(400 * MB))
    assert cost_to_json(pj, BW)["parts"] == 0
    pj["split"] = ["blocks.3"]
    for s in pj["segments"]:
        s["units"] = [u for name in s["units"] for u in ([f"{name}.0", f"{name}.1"] if name == "blocks.3" else [name])]
    c = cost_to_json(pj, BW)
    assert c["blocks"] == 10 and c["parts"] == 11
    streamed = [u for s in pj["segments"] if not s["resident"] and not s["idle"] for u in s["units"]]
    assert c["parts_streamed"] == len(streamed)
    assert c["blocks_streamed"] == len({u.rsplit(".", 1)[0] if u.startswith("blocks.3.") else u for u in streamed})
