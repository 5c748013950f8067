"""The node tells each model's truth: what a new user reads on the Max VRAM node, checked on the
page as drawn (the texts the plan drew, their boxes, the canvas's pixels, the DOM).

One test per defect a new user met: each refused model with its own number and the banner with
the one that makes all fit; a MODEL preview that assumes what sampling does (cond and uncond
batched) with a way to preview CFG 1; one precision for a budget and a need; a plan from history
only on the workflow whose run made it; one vocabulary (blocks, parts, segments, copies, per
call); nothing cut at the default width; nodes that shrink with their content; the inputs named
as a user knows them. The page helpers are test_browser.py's and test_node_look.py's.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_browser as tb
from test_node_look import PIXELS_JS, _set_width, _vae_run, _view
from graphs import clear_and_build

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

DEFAULT_WIDTH = 360
GIB = 1 << 30
FIGURE_RE = re.compile(r"(\d+\.\d+) (?:/ (\d+\.\d+) )?GiB(?!/s)")  # a budget or a need, not a bandwidth
TINY_REFUSED_GB = 0.03       # the tiny SD3 (needs 0.039) and the SD VAE (5.590) refused at 256x256, batch 4
PREVIEW_SIDE = 256           # the tiny SD3 takes at most 256 px
PREVIEW_BATCH = 4

# Max VRAM with the tiny SD3, the SD VAE (or either) and a Preview shape, built in the page and
# queued (a preview only: Max VRAM is an output node).
PREVIEW_GRAPH_JS = """
const [model, vae, budget, side, batch, cfgBatch, firstId, done] = arguments;
(async () => {
  app.graph.clear();
  let nextId = firstId;
  const add = (type, pos) => { const n = LiteGraph.createNode(type); n.id = nextId++; n.pos = pos; app.graph.add(n); return n; };
  const set = (n, k, v) => { const w = n.widgets.find((w) => w.name === k); if (!w) throw new Error(n.type + " has no " + k); w.value = v; };
  const cut = add("%(node)s", [340, 90]);
  set(cut, "max_vram_gb", budget);
  if (model) {
    const u = add("UNETLoader", [20, 90]); set(u, "unet_name", model);
    u.connect(0, cut, cut.findInputSlot("model"));
  }
  if (vae) {
    const v = add("VAELoader", [20, 240]); set(v, "vae_name", vae);
    v.connect(0, cut, cut.findInputSlot("vae"));
  }
  const shape = add("VRAMCutPreviewShape", [20, 360]);
  set(shape, "width", side); set(shape, "height", side); set(shape, "batch", batch);
  if (cfgBatch !== null) set(shape, "cfg_batch", cfgBatch);
  shape.connect(0, cut, cut.findInputSlot("preview_shape"));
  app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0]; app.canvas.setDirty(true, true);
  const { api } = await import("/scripts/api.js");
  window.__vramcutDone = false;
  api.addEventListener("executing", (e) => { if (e.detail === null || (e.detail && e.detail.node === null)) window.__vramcutDone = true; });
  api.addEventListener("execution_success", () => { window.__vramcutDone = true; });
  await app.queuePrompt(0);
  done({cut: cut.id, shape: shape.id});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": tb.NODE_TYPE}


def _preview(browser, s, budget, *, model=True, vae=True, side=PREVIEW_SIDE, batch=PREVIEW_BATCH, cfg_batch=None,
             first_id=3001):
    """The preview graph run; the node's raw payload and its view once the run has drawn."""
    tb._open(browser, s)
    ids = browser.execute_async_script(PREVIEW_GRAPH_JS, s.tiny_model if model else None,
                                       s.sd_vae if vae else None, budget, side, batch, cfg_batch, first_id)
    assert "error" not in ids, ids["error"]
    want = int(model) + int(vae)
    cut = ids["cut"]
    raw = tb._wait(browser, "the preview drawn", lambda: browser.execute_script("return window.__vramcutDone") and (
        (r := browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.raw", cut))
        and len(r["models"]) == want and all(m["stage"] == "traced" or m.get("refused") for m in r["models"]) and r),
        timeout=tb.PROMPT_TIMEOUT_S)
    time.sleep(0.5)  # drawn
    return ids, raw, _view(browser, cut)


def _tips(browser, node_id) -> list[str]:
    return browser.execute_script(
        "return app.graph.getNodeById(arguments[0]).vramcutView.regions.map((r) => r.tip || '')", node_id)


def _gib(n) -> str:
    """What the node writes for a budget that holds ``n`` bytes (plan.py gib_text)."""
    import math

    k = max(1, math.ceil(n / GIB / 0.001 - 1e-9))
    while int(float(f"{k * 0.001:.3f}") * GIB) < n:
        k += 1
    return f"{k * 0.001:.3f}"


# ------------------------------------------------------------------ 1: each model's own number

def test_each_refused_model_shows_its_own_budget_and_the_banner_the_one_that_fits_all(comfy_server, browser):
    """The tiny SD3 and the SD VAE refused at one budget: each model's row names the smallest
    budget that model needs alone (as a run of that model alone says), the banner and the
    collapsed title the largest (each model gets the whole budget in turn)."""
    s = comfy_server
    alone = {}
    for kind, flags, first in (("MODEL", dict(vae=False), 3101), ("VAE", dict(model=False), 3201)):
        _, raw, _ = _preview(browser, s, TINY_REFUSED_GB, first_id=first, **flags)
        assert raw["message_level"] == "error" and raw.get("min_budget_bytes"), raw["message"]
        alone[kind] = _gib(raw["min_budget_bytes"])
    assert alone["MODEL"] != alone["VAE"], alone
    both = max(alone.values(), key=float)

    ids, raw, v = _preview(browser, s, TINY_REFUSED_GB, first_id=3301)
    rows = dict(zip([m["kind"] for m in raw["models"]], v["data"]["answers"].split("\n")))
    for kind, need in alone.items():
        assert rows[kind].startswith(f"refused · needs {need} / "), (kind, rows[kind], alone)
    assert v["data"]["fix"] == f"Set max_vram_gb to {both}.", (v["data"]["fix"], alone)
    banner = " ".join(t["text"] for t in v["texts"] if t["kind"] == "banner")
    assert f"Set max_vram_gb to {both}" in banner, banner

    cut = ids["cut"]
    browser.execute_script(tb.ZOOM_JS, cut, 1.0, True)
    title = browser.execute_script("return app.graph.getNodeById(arguments[0]).getTitle()", cut)
    browser.execute_script(tb.ZOOM_JS, cut, 1.0, False)
    assert both in title and all(n not in title for n in alone.values() if n != both), (title, alone)


# ---------------------------------------------------- 2: the MODEL preview assumes CFG batching

def test_model_preview_assumes_cond_and_uncond_batched_with_a_way_to_preview_cfg_1(comfy_server, browser):
    """Preview shape has a cfg_batch switch, on by default: the MODEL is traced at twice the batch
    (what KSampler with CFG above 1 runs) and the node says so; off, the batch alone (CFG 1,
    distilled models). A workflow saved with the four older values loads with them in place and
    the switch on; the example's note and the switch's tooltip tell which to use."""
    s = comfy_server
    tb._open(browser, s)
    info = s.get("/object_info/VRAMCutPreviewShape")["VRAMCutPreviewShape"]["input"]
    spec = {**info.get("required", {}), **info.get("optional", {})}
    assert "cfg_batch" in spec and spec["cfg_batch"][1].get("default") is True, spec.keys()
    assert "CFG" in spec["cfg_batch"][1]["tooltip"] and "distilled" in spec["cfg_batch"][1]["tooltip"]

    _, raw, v = _preview(browser, s, 1.0, vae=False, side=64, batch=1, first_id=3401)
    (m,) = raw["models"]
    assert "×2" in m["traced_at"] and "cond + uncond" in m["traced_at"], m["traced_at"]
    _, raw1, _ = _preview(browser, s, 1.0, vae=False, side=64, batch=1, cfg_batch=False, first_id=3501)
    (m1,) = raw1["models"]
    assert "CFG 1" in m1["traced_at"], m1["traced_at"]
    # twice the batch: more activations
    assert m["plan"]["activation_reserve_bytes"] > m1["plan"]["activation_reserve_bytes"], (m["plan"], m1["plan"])

    # the example: saved before the switch (four values), it loads with them and the switch on
    wf = json.load(open(os.path.join(tb.EXAMPLES, f"{tb.RUNNABLE_EXAMPLE}.json"), encoding="utf-8"))
    shape = next(n for n in wf["nodes"] if n["type"] == "VRAMCutPreviewShape")
    note = next(n for n in wf["nodes"] if n["type"] == "Note")["widgets_values"][0]
    assert "cfg_batch" in note and "CFG" in note, note
    shape["widgets_values"] = shape["widgets_values"][:4]
    got = browser.execute_async_script("""
      const [wf, done] = arguments;
      app.loadGraphData(wf).then(() => {
        const n = app.graph.nodes.find((n) => n.type === "VRAMCutPreviewShape");
        done(Object.fromEntries(n.widgets.map((w) => [w.name, w.value])));
      });""", wf)
    assert got == {"width": 1024, "height": 1024, "frames": 1, "batch": 1, "cfg_batch": True}, got


# ------------------------------------------------------------------- 3: one precision (three)

def test_budgets_and_needs_read_to_the_thousandth_everywhere(comfy_server, browser):
    """A plan and a refusal: every GiB figure the node draws, its tooltips and its error message
    carry the widget's three decimals (no "2.25 GiB" beside "2.248")."""
    s = comfy_server
    ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 3601, details=True)
    tb._wait_run(browser, s, ids["cut"], "measured")
    texts = [t["text"] for t in _view(browser, ids["cut"])["texts"]] + _tips(browser, ids["cut"])
    refused = _vae_run(browser, s, tb.REFUSED_BUDGET_GB, 3701, details=False, latent=512)
    tb._wait_events(browser, refused["cut"], "execution_error", "execution_success")
    v = tb._wait(browser, "the refusal drawn", lambda: (x := _view(browser, refused["cut"]))["data"].get("state") == "refused" and x)
    texts += [t["text"] for t in v["texts"]] + _tips(browser, refused["cut"]) + [v["data"]["message"]]
    tb._close_error_dialog(browser)
    figures = [f for t in texts for pair in FIGURE_RE.findall(t) for f in pair if f]
    assert len(figures) >= 6, texts
    assert all(len(f.split(".")[1]) == 3 for f in figures), [t for t in texts if FIGURE_RE.search(t)]
    assert "0.050 GiB is too small" in v["data"]["message"], v["data"]["message"]


# --------------------------------------------------------- 4: a plan belongs to the run that made it

HAS_PLAN_JS = ("const n = app.graph.getNodeById(arguments[0]);"
               "return n && n.vramcutView ? n.vramcutView.el.dataset.hasPlan : null")


def test_a_look_alike_graph_never_gets_the_plan_of_a_run_it_did_not_make(comfy_server, browser):
    """Clear, build and run; clear, build the same graph again and do not run it; reload: the
    never-run node shows no plan (the run's workflow was cleared; this one never ran)."""
    s = comfy_server
    tb._open(browser, s)
    r = clear_and_build(browser, s.tiny_model)
    tb._wait(browser, "the run's plan", lambda: browser.execute_script(HAS_PLAN_JS, r["id"]) == "true")
    time.sleep(1.0)
    again = clear_and_build(browser, s.tiny_model, queue=False)
    assert again["id"] == r["id"], again
    assert browser.execute_script(HAS_PLAN_JS, again["id"]) == "false"
    time.sleep(1.5)  # the workflow is kept in the browser's storage
    tb._open(browser, s, fresh=False)
    tb._wait(browser, "the node after the reload", lambda: browser.execute_script(HAS_PLAN_JS, again["id"]) is not None)
    time.sleep(3.0)  # the history has been asked and answered
    assert browser.execute_script(HAS_PLAN_JS, again["id"]) == "false", "a never-run node shows another run's plan"


# ------------------------------------------------------------------------ 5: one vocabulary

PARTS_PAYLOAD = {
    "budget_bytes": 300 << 20, "enabled": True, "message": None, "models": [{
        "kind": "MODEL", "label": "MODEL · toy", "stage": "measured", "inputs": "latent 64×64, batch 2",
        "warnings": [], "text": "", "plan": {
            "budget_bytes": 300 << 20, "peak_bytes": 250 << 20, "resident_bytes": 100 << 20,
            "window_bytes": 100 << 20, "activation_reserve_bytes": 50 << 20, "streamed_bytes_per_forward": 200 << 20,
            "transfers_per_forward": 2, "measured": True, "split": ["blocks.1"],
            "units": [], "segments": [
                {"name": "blocks.0", "units": ["blocks.0"], "weight_bytes": 100 << 20, "activation_bytes": 1 << 20,
                 "peak_bytes": 101 << 20, "resident": True},
                {"name": "blocks.1.0 … blocks.1.1", "units": ["blocks.1.0", "blocks.1.1"], "weight_bytes": 100 << 20,
                 "activation_bytes": 1 << 20, "peak_bytes": 101 << 20, "resident": False},
                {"name": "blocks.1.2 … blocks.2", "units": ["blocks.1.2", "blocks.2"], "weight_bytes": 100 << 20,
                 "activation_bytes": 1 << 20, "peak_bytes": 101 << 20, "resident": False}],
            "cost": {"fits": True, "peak_is_lower_bound": False, "blocks": 3, "blocks_streamed": 2, "parts": 5,
                     "parts_streamed": 4, "streamed_bytes_per_forward": 200 << 20, "transfers_per_forward": 2,
                     "bandwidth_bytes_per_s": 10 * GIB, "bandwidth_device": "cuda:0", "added_s_per_forward": 0.02,
                     "added_source": "estimate", "measured_forwards": 0}}}]}

DEVELOPER_WORDS = re.compile(r"\b(transfers?|forwards?|per step|/ ?step|units?)\b")


def test_one_vocabulary_on_the_answer_details_table_and_tooltips(comfy_server, browser):
    """A measured VAE plan with its details, and a plan with blocks cut into parts: the answer
    line, the counts, the table and every tooltip say blocks, parts, segments, copies and per
    call (never transfers, forwards or steps), the counts name the parts, and no "(estimate)"
    stands beside a "measured" badge."""
    from selenium.webdriver.common.by import By

    s = comfy_server
    ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 3801, details=True)
    cut = ids["cut"]
    tb._wait_run(browser, s, cut, "measured")
    for payload in (None, PARTS_PAYLOAD):
        if payload:
            browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1])", cut, payload)
            time.sleep(0.5)
        v = _view(browser, cut)
        browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()
        table = tb._wait(browser, "the table", lambda: browser.execute_script(
            "const t = app.graph.getNodeById(arguments[0]).vramcutView.pre; return t.style.display !== 'none' && t.textContent", cut))
        browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()
        words = [t["text"] for t in v["texts"]] + _tips(browser, cut) + [table]
        said = [w for w in words if DEVELOPER_WORDS.search(w)]
        assert not said, said
        counts = " ".join(t["text"] for t in v["texts"] if t["kind"] == "counts")
        assert re.search(r"\d+ cop(y|ies) per call", counts), counts
        answer = " ".join(t["text"] for t in v["texts"] if t["kind"] == "answer")
        assert "/ call" in answer or "time not measured" in answer, answer
        badges = [t["text"] for t in v["texts"] if t["kind"] == "badge"]
        if "measured" in badges:
            assert "(estimate)" not in answer, answer
    assert "3 blocks (cut into 5 parts)" in counts, counts
    assert "2 of 3 blocks streamed" in answer, answer


# ----------------------------------------------------------- 6: nothing cut at the default width

TITLE_STRINGS_JS = """
const n = app.graph.getNodeById(arguments[0]);
const seen = [];
const orig = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (t, ...rest) { seen.push(String(t)); return orig.call(this, t, ...rest); };
try { app.canvas.draw(true, true); } finally { CanvasRenderingContext2D.prototype.fillText = orig; }
return seen;
"""

# Every part of each segment name in the table ("decoder", "up", "3", "post", "quant") on one line.
TABLE_BREAKS_JS = """
const v = app.graph.getNodeById(arguments[0]).vramcutView, t = v.pre;
const broken = [];
for (const td of t.querySelectorAll("tr[data-where] > td")) {
  const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const re = /[A-Za-z0-9]+/g;
    let m;
    while ((m = re.exec(node.data))) {
      const r = document.createRange();
      r.setStart(node, m.index); r.setEnd(node, m.index + m[0].length);
      const tops = new Set([...r.getClientRects()].map((x) => Math.round(x.top)));
      if (tops.size > 1) broken.push(m[0]);
    }
  }
}
const heads = [...t.querySelectorAll("th")].map((h) => h.textContent);
const rows = t.querySelectorAll("tr[data-where]").length;
const e = v.el.getBoundingClientRect();
const visible = [...t.querySelectorAll("tr[data-where]")].filter((r) => r.getBoundingClientRect().bottom <= Math.min(e.bottom, t.getBoundingClientRect().bottom) + 0.5).length;
return {broken, heads, rows, visible, segments: v.payload.models.reduce((n, m) => n + m.plan.segments.length, 0)};
"""

NOTES_JS = """
const th = LiteGraph.NODE_TITLE_HEIGHT;
const box = (n) => [n.pos[0], n.pos[1] - th, n.size[0], n.size[1] + th];
const notes = app.graph.nodes.filter((n) => n.type === "Note");
return notes.map((n) => {
  const ta = document.querySelector(`[data-node-id="${n.id}"] textarea`) ||
    [...document.querySelectorAll("textarea")].find((t) => t.value === n.widgets[0].value);
  const touching = app.graph.nodes.filter((o) => o !== n && (() => {
    const [ax, ay, aw, ah] = box(n), [bx, by, bw, bh] = box(o);
    return ax < bx + bw + 4 && bx < ax + aw + 4 && ay < by + bh + 4 && by < ay + ah + 4;
  })()).map((o) => o.type);
  return {cut: ta ? ta.scrollHeight > ta.clientHeight + 1 : null, touching};
});
"""

LONG_WARNING = ("budget leaves no room for prefetch: each streamed segment is copied while compute waits; "
                "raise max_vram_gb by one segment's weights to let copies overlap")


def test_nothing_is_cut_or_clipped_at_the_default_width(comfy_server, browser):
    """At the default width: a long warning and a refusal read whole (no "…"), the collapsed
    refused title keeps the node's name whole, the table shows every row with a peak column and
    wraps names only between their parts, a segment label is not cut by a divider, a plan
    restored into a shorter saved node grows it, and the examples' notes are whole and clear of
    the other nodes."""
    from selenium.webdriver.common.by import By

    s = comfy_server
    # a refusal, whole, and its collapsed title
    ids = _vae_run(browser, s, tb.REFUSED_BUDGET_GB, 3901, details=False, latent=512)
    cut = ids["cut"]
    tb._wait_events(browser, cut, "execution_error", "execution_success")
    v = tb._wait(browser, "the refusal drawn", lambda: (x := _view(browser, cut))["data"].get("state") == "refused" and x)
    tb._close_error_dialog(browser)
    v = _set_width(browser, cut, DEFAULT_WIDTH)
    assert not [t for t in v["texts"] if t["text"].endswith("…")], v["texts"]
    banner = " ".join(t["text"] for t in v["texts"] if t["kind"] == "banner")
    assert banner.rstrip(".").endswith(v["data"]["message"].rstrip(".").split()[-1]), (banner, v["data"]["message"])
    browser.execute_script(tb.ZOOM_JS, cut, 1.0, True)
    time.sleep(0.3)
    drawn = browser.execute_script(TITLE_STRINGS_JS, cut)
    browser.execute_script(tb.ZOOM_JS, cut, 1.0, False)
    title = [t for t in drawn if t.startswith("Max VRAM")]
    assert title and not any(t.endswith("…") for t in title), drawn

    # a measured plan with its details: a long warning whole, the "encoder" label uncut, the table
    ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 4001, details=True)
    cut = ids["cut"]
    tb._wait_run(browser, s, cut, "measured")
    v = _set_width(browser, cut, DEFAULT_WIDTH)
    groups = [b for b in v["bars"] if b.get("group")]
    for g in groups:
        (t,) = [t for t in v["texts"] if t["kind"] == "segment" and t["text"] == g["label"] and abs(t["x"] - g["x"] - 3) < 1]
        (box,) = browser.execute_script(PIXELS_JS, cut, [[t["x"], g["y"] + 2, t["w"], g["h"] - 4]], False)
        assert box["painted"] == box["w"] * box["h"], ("a divider cuts the label", g["label"], box)
    raw = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.raw", cut)
    raw = json.loads(json.dumps(raw))
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()
    table = tb._wait(browser, "the table laid out", lambda: (
        (x := browser.execute_script(TABLE_BREAKS_JS, cut))["rows"] and x["visible"] == x["rows"] and x), timeout=10)
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()
    assert table["rows"] == table["segments"] and "peak" in table["heads"] and not table["broken"], table

    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutSetDetails(false)", cut)
    raw["models"][0]["warnings"] = [LONG_WARNING]
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1])", cut, raw)
    v = tb._wait(browser, "the warning drawn", lambda: (
        (x := _view(browser, cut))["fits"] and any("⚠" in t["text"] for t in x["texts"]) and x))
    warning = " ".join(t["text"] for t in v["texts"] if t["text"].startswith("⚠") or t.get("kind") == "warning")
    assert warning.endswith("to let copies overlap") and "…" not in warning, v["texts"]

    # a plan restored into a node saved shorter than it
    browser.execute_script("const n = app.graph.getNodeById(arguments[0]); n.setSize([n.size[0], n.computeSize()[1]]);"
                           "app.canvas.setDirty(true, true);"
                           "const ct = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;"  # as a mouse-up does
                           "if (typeof ct?.captureCanvasState === 'function') ct.captureCanvasState(); else ct?.checkState?.();", cut)
    time.sleep(1.5)  # the workflow is kept in the browser's storage
    tb._open(browser, s, fresh=False)
    tb._wait(browser, "the restored plan shown whole", lambda: (
        browser.execute_script(HAS_PLAN_JS, cut) == "true" and _view(browser, cut)["fits"]), timeout=15)

    # the examples' notes
    for name in (tb.RUNNABLE_EXAMPLE, tb.FLUX_EXAMPLE):
        opened = tb._open_runnable_example(browser, s, name)
        notes = browser.execute_script(NOTES_JS)
        assert notes and all(n["cut"] is False and not n["touching"] for n in notes), (name, notes)
        # the Max VRAM node as saved shows its guidance whole
        node = tb._wait(browser, "the example's node drawn", lambda: (
            (x := _view(browser, opened["id"])) and x["H"] and x["data"].get("contentHeight") and x), timeout=10)
        assert int(node["data"]["contentHeight"]) <= node["H"] + 1, (name, node["data"], node["H"])
        assert not [t for t in node["texts"] if t["text"].endswith("…")], (name, node)


# ------------------------------------------------------------ 7: nodes shrink with their content

def test_the_node_shrinks_when_its_content_gets_shorter(comfy_server, browser):
    """A plan with three long warnings and its details, then the same plan without them: the node
    is as tall as its content each time (no empty band below); the table grows the node to every
    row, and closing it brings the node back."""
    from selenium.webdriver.common.by import By

    s = comfy_server
    ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 4101, details=True)
    cut = ids["cut"]
    tb._wait_run(browser, s, cut, "measured")
    raw = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.raw", cut)
    long = json.loads(json.dumps(raw))
    long["models"][0]["warnings"] = [f"{i}: {LONG_WARNING}" for i in range(3)]
    sizes = []
    for payload in (long, raw):
        browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1])", cut, payload)
        v = tb._wait(browser, "the node fitted to its content", lambda: (
            (x := _view(browser, cut)) and x["fits"] and x["size"][1] and
            abs(x["H"] - browser.execute_script("const v = app.graph.getNodeById(arguments[0]).vramcutView;"
                                                "return v.contentHeight(v.el.clientWidth)", cut)) <= 1 and x), timeout=10)
        sizes.append(v["size"][1])
    assert sizes[1] < sizes[0] - 40, sizes

    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()
    grown = tb._wait(browser, "the node grown to the table", lambda: (
        (x := browser.execute_script(TABLE_BREAKS_JS, cut))["rows"] and x["visible"] == x["rows"]
        and _view(browser, cut)["size"][1]), timeout=10)
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()
    tb._wait(browser, "the node back to the chart", lambda: abs(_view(browser, cut)["size"][1] - sizes[1]) <= 2, timeout=10)
    assert grown > sizes[1], (grown, sizes)


# --------------------------------------------------- 8: the inputs named as a user knows them

def test_the_inputs_are_named_as_a_user_knows_them(comfy_server, browser):
    """A measured VAE decode: the details and the badge's tooltip say "latent 8×8", never the
    engine's "arg0 1x4x8x8 float32"."""
    s = comfy_server
    ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 4201, details=True)
    cut = ids["cut"]
    tb._wait_run(browser, s, cut, "measured")
    v = _view(browser, cut)
    shown = [t["text"] for t in v["texts"]] + _tips(browser, cut)
    table = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.pre.textContent", cut)
    assert not [t for t in shown + [table] if re.search(r"\barg\d|float\d+|\d+x\d+x\d+", t)], shown + [table]
    counts = " ".join(t["text"] for t in v["texts"] if t["kind"] == "counts")
    assert "latent 8×8, batch 1" in counts, counts
    assert any("Measured for latent 8×8, batch 1" in t for t in _tips(browser, cut)), _tips(browser, cut)
