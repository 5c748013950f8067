"""One plan's figures, wherever the node shows them: the answer line, the details (the counts under
the chart), the tooltips and the table report the same bytes and copy counts for the same call,
with the measuring call named apart from the calls that run the plan. For a streamed, a fully
resident and a refused VAE, each really run in ComfyUI (two decodes in one prompt: the first
measures, the second runs the plan).

Before this test, the tooltip wrote a figure the table wrote otherwise ("126 MiB" against
"125.8 MiB" for the same bytes), and the table said the resident blocks were copied "once" where
each decode had copied them again.

The page helpers are test_browser.py's and test_node_look.py's.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_browser as tb  # noqa: E402
from test_node_look import _view  # noqa: E402

from vramcut_core.model.tensors import fmt_bytes  # noqa: E402

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

BYTES = r"(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB))"

SURFACES_JS = """
const v = app.graph.getNodeById(arguments[0]).vramcutView;
v.toggleTable(true);
const table = v.pre.innerText;
v.toggleTable(false);
return {texts: v.texts || [], tips: v.regions.map((r) => r.tip || ""), table, payload: v.payload};
"""


def _surfaces(browser, cut) -> dict:
    _view(browser, cut)  # drawn once more, so that the texts are the ones on screen now
    s = browser.execute_script(SURFACES_JS, cut)
    kinds = lambda k: " ".join(t["text"] for t in s["texts"] if t["kind"] == k)  # noqa: E731
    (model,) = s["payload"]["models"]
    return {"answer": kinds("answer"), "counts": kinds("counts"), "tips": s["tips"], "table": s["table"],
            "model": model, "plan": model["plan"]}


def _run_two_decodes(browser, s, budget_gb, first_id) -> dict:
    tb._open(browser, s)
    ids = browser.execute_async_script(tb.BUILD_VAE_GRAPH_JS, s.sd_vae, budget_gb, first_id)
    assert "error" not in ids, ids["error"]
    cut = ids["cut"]
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutSetDetails(true)", cut)
    more = browser.execute_script(tb.SECOND_DECODE_JS, cut, ids["decode"], ids["preview"])
    assert browser.execute_async_script(tb.QUEUE_JS, [ids["decode"], ids["preview"], *more], 0) is True
    tb._wait_run(browser, s, cut, "measured")
    tb._wait(browser, "the second decode's figures", lambda: browser.execute_script(
        "return app.graph.getNodeById(arguments[0]).vramcutView.payload.models[0].plan.cost.measured_forwards", cut) == 1)
    return _surfaces(browser, cut)


def _one(pattern, text, what):
    found = re.findall(pattern, text, re.M)
    assert len(found) == 1, (what, pattern, text)
    return found[0]


@pytest.mark.parametrize("where", ["streamed", "resident"])
def test_answer_details_tooltip_and_table_agree_on_one_calls_bytes_and_copies(comfy_server, browser, where):
    budget = tb.VAE_BUDGET_GB if where == "streamed" else tb.ALL_RESIDENT_GB
    v = _run_two_decodes(browser, comfy_server, budget, 5101 if where == "streamed" else 5201)
    plan, c = v["plan"], v["plan"]["cost"]
    x, n = fmt_bytes(plan["streamed_bytes_per_forward"]), plan["transfers_per_forward"]
    # the call after the measuring one ran the plan: what it streamed is what the plan streams
    assert (c["measured_bytes_per_forward"], c["measured_copies_per_forward"]) == \
        (plan["streamed_bytes_per_forward"], n), c
    assert (n > 0) == (where == "streamed"), plan

    # the answer line: the blocks the plan streams
    if where == "streamed":
        assert f"{c['blocks_streamed']} of {c['blocks']} blocks streamed" in v["answer"], v["answer"]
        # the details: the plan's copies per call
        assert _one(r"(\d+) cop(?:y|ies) per call", v["counts"], "details") == str(n), v["counts"]
    else:
        assert f"all {c['blocks']} blocks resident" in v["answer"], v["answer"]
        assert re.search(r"\b0 streamed\b", v["counts"]) and "per call" not in v["counts"], v["counts"]

    # the time tooltip: the measured call and the plan, the same bytes written the same way
    (tip,) = [t for t in v["tips"] if "Bandwidth" in t]
    assert "after the measuring one" in tip, tip  # which call the measured figures are
    assert _one(r"Measured " + BYTES + r" streamed per call in (\d+) cop", tip, "tooltip, measured") == (x, str(n))
    if where == "streamed":
        assert _one(r"The plan streams " + BYTES + r" per call in (\d+) cop", tip, "tooltip, plan") == (x, str(n))
    # every other tooltip calls a segment streamed only where the table does
    streamed_tips = [t for t in v["tips"] if "· streamed" in t]
    streamed_rows = re.findall(r"^.*\tstreamed\t.*$", v["table"], re.M)
    assert len(streamed_tips) == len(streamed_rows) == (n if where == "streamed" else 0), (streamed_tips, streamed_rows)

    # the table: the plan's call, the call after the measuring one, and the two calls in all
    table = v["table"]
    assert _one(r"^streamed per call " + BYTES + r" in (\d+) cop", table, "table, plan") == (x, str(n))
    assert _one(r"^per call after measuring \(1\): streamed " + BYTES + r" in (\d+) cop", table,
                "table, the call after the measuring one") == (x, str(n))
    total, copies = _one(r"^measured: 2 calls, the measuring one included .*: streamed " + BYTES + r" in (\d+) cop",
                         table, "table, both calls")
    assert int(copies) >= n, table
    # resident copies are never called streamed, and never "once" where each decode copied them
    resident = re.search(r"(\d+) resident cop(?:y|ies) \(([^)]*)\)", table)
    assert resident, table
    assert resident.group(2) != "once" or int(resident.group(1)) <= len(
        [u for s in plan["segments"] if s["resident"] for u in s["units"]]), table
    if where == "resident":
        assert total == "0 B" and copies == "0", table
        assert not any(re.search(BYTES + " streamed", t) and not re.search("0 B streamed", t) for t in v["tips"]), v["tips"]


def test_a_refused_models_figures_are_the_refusal_everywhere(comfy_server, browser):
    """A refused decode: the answer line, the table and the tooltips give the refusal's number,
    and none of them the plan drawn before the run (no streamed bytes, no copies)."""
    s = comfy_server
    tb._open(browser, s)
    ids = browser.execute_async_script(tb.BUILD_VAE_GRAPH_JS, s.sd_vae, tb.REFUSED_BUDGET_GB, 5301)
    assert "error" not in ids, ids["error"]
    browser.execute_script("const n = app.graph.nodes.find((n) => n.type === 'EmptyLatentImage');"
                           "n.widgets[0].value = 512; n.widgets[1].value = 512;")
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutSetDetails(true)", ids["cut"])
    assert browser.execute_async_script(tb.QUEUE_JS, [ids["decode"], ids["preview"]], 0) is True
    tb._wait_events(browser, ids["cut"], "execution_error", "execution_success")
    v = tb._wait(browser, "the refusal drawn", lambda: (
        (x := _surfaces(browser, ids["cut"]))["answer"].startswith("refused") and x))
    need = _one(r"needs (\d+\.\d{3}) / ", v["answer"], "answer")
    assert v["model"].get("refused") is True, v["model"]
    assert need in v["table"] and "refused" in v["table"], v["table"]
    said = [t for t in v["tips"] + [v["table"], v["counts"]] if re.search(r"streamed per call|cop(?:y|ies) per call", t)]
    assert not said, ("the plan drawn before the run", said)
