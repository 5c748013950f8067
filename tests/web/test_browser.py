"""End to end: the real pack in a real ComfyUI server, the plan drawn by web/vramcut.js in
headless Chromium.

1. The server answers an API prompt ``UNETLoader -> VRAMCutMaxVRAM`` with the node's ``ui``
   output holding a plan (the data contract the frontend draws).
2. The example workflows are valid UI-format workflows and the server lists and serves them as
   this pack's templates.
3. In the browser: load ``example_workflows/VRAMCut - plan preview.json`` (fetched from the
   template route), point it at the tiny model, queue it, and check the plan is drawn: the
   widget's data attributes (DOM) and its pixels (resident and streamed colours on screen).
   A screenshot is saved under tests/web/artifacts/ (or $VRAMCUT_WEB_ARTIFACTS).
4. The drawing survives a reload of the saved workflow (no re-run), and a live
   ``vramcut.plan`` event (as sent during sampling, here for a subgraph path id) updates it.
5. A real decode in the browser: ``VAELoader -> Max VRAM -> VAEDecode -> PreviewImage`` built
   in the page and queued with the decode muted (the node draws the weights-only plan), then
   whole: the decode measures the shapes and the server's live event redraws the node with the
   measured plan (activations, idle encoder) while the run goes on. (The README picture
   ``docs/node_plan.png`` is written by test_node_look.py's ``test_docs_pictures``.)

Install for CI: ``apt-get install -y chromium chromium-driver`` and ``pip install selenium``.
"""
from __future__ import annotations

import io
import json
import os
import re
import time

import urllib.parse

import pytest

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "example_workflows")
ARTIFACTS = os.environ.get("VRAMCUT_WEB_ARTIFACTS", os.path.join(HERE, "artifacts"))
NODE_TYPE = "VRAMCutMaxVRAM"
RUNNABLE_EXAMPLE = "VRAMCut - plan preview"
FLUX_EXAMPLE = "VRAMCut - Flux on a budget"
WIDGETS = ["max_vram_gb", "budget_mode", "reserve_gb", "prefetch", "residency"]

TINY_UNITS = 7               # the tiny SD3's units (blocks) as the planner cuts it
TINY_SHAPE = (64, 64)        # the example's preview shape set for the tiny SD3 (it takes <= 256 px): 2 resident segments at TINY_BUDGET_GB
WIDGETS_HEIGHT_MAX = 264     # the six widgets, the five socket rows (preview_shape and devices: +20 each), the title and margins, in graph units
MIN_PLAN_ROW = 24            # web/vramcut.js MIN_WIDGET_HEIGHT: the header row

PROMPT_TIMEOUT_S = 120
UI_TIMEOUT_S = 60
COLOR_TOLERANCE = 10


def _api_prompt(model: str, budget_gb: float) -> dict:
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": model, "weight_dtype": "default"}},
        "2": {"class_type": NODE_TYPE, "inputs": {
            "max_vram_gb": budget_gb, "budget_mode": "fixed", "reserve_gb": 1.0, "prefetch": True,
            "residency": True, "model": ["1", 0]}},
    }


def _template_url(server, name: str, ext: str = "json", api: bool = True) -> str:
    """Where the server serves this pack's example ``name`` (a file name with spaces)."""
    return f"{server.url if api else ''}/api/workflow_templates/{server.pack_folder}/{urllib.parse.quote(name)}.{ext}"


def _wait_history(server, prompt_id: str) -> dict:
    return server.wait_history(prompt_id, PROMPT_TIMEOUT_S)


def test_prompt_returns_plan(comfy_server):
    s = comfy_server
    r = s.post("/prompt", {"prompt": _api_prompt(s.tiny_model, s.tiny_budget_gb), "client_id": "vramcut-test"})
    assert not r.get("node_errors"), r
    entry = _wait_history(comfy_server, r["prompt_id"])
    assert entry["status"]["status_str"] == "success", (entry["status"], comfy_server.log_tail())

    payloads = entry["outputs"]["2"]["vramcut"]
    assert isinstance(payloads, list) and len(payloads) == 1
    payload = payloads[0]
    assert payload["enabled"] is True and payload["message"] is None
    assert payload["budget_bytes"] == int(s.tiny_budget_gb * 1024**3)
    (model,) = payload["models"]
    assert model["kind"] == "MODEL" and model["stage"] in ("weights", "measured")
    assert isinstance(model["text"], str) and model["text"]
    plan = model["plan"]
    for key in ("budget_bytes", "peak_bytes", "streamed_bytes_per_forward", "resident_bytes",
                "window_bytes", "activation_reserve_bytes", "measured", "units", "segments"):
        assert key in plan, key
    segs = plan["segments"]
    assert any(s["resident"] for s in segs) and any(not s["resident"] for s in segs), model["text"]
    assert plan["peak_bytes"] <= plan["budget_bytes"]
    assert sum(len(s["units"]) for s in segs) == len(plan["units"])
    # the answer line's figures: before a run the time is an estimate from this machine's bandwidth
    cost = plan["cost"]
    assert cost["fits"] is True and cost["blocks"] == len(plan["units"])
    assert cost["blocks_streamed"] == sum(len(s["units"]) for s in segs if not s["resident"] and not s["idle"])
    assert cost["bandwidth_device"] == "cpu" and cost["bandwidth_bytes_per_s"] > 0, cost
    assert cost["added_source"] == "estimate" and cost["measured_s_per_forward"] is None, cost
    assert cost["added_s_per_forward"] == pytest.approx(plan["streamed_bytes_per_forward"] / cost["bandwidth_bytes_per_s"])


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(EXAMPLES) if f.endswith(".json")))
def test_example_workflow_is_a_template(comfy_server, name):
    with open(os.path.join(EXAMPLES, name + ".json"), encoding="utf-8") as f:
        wf = json.load(f)
    # UI format as the frontend saves it: nodes with widgets_values, links as arrays
    assert {"nodes", "links", "last_node_id", "last_link_id", "version"} <= set(wf)
    nodes = [n for n in wf["nodes"] if n["type"] == NODE_TYPE]
    assert nodes, "the example has no Max VRAM node"
    info = comfy_server.get(f"/object_info/{NODE_TYPE}")[NODE_TYPE]
    assert info["input_order"]["required"] == WIDGETS  # the widget order the examples were saved with
    # the frontend saves a widget for every primitive input, the optional ones after the required
    optional = [k for k in info["input_order"].get("optional", [])
                if info["input"]["optional"][k][0] in ("FLOAT", "INT", "BOOLEAN", "STRING")]
    assert optional == ["max_ram_gb"], optional
    for n in nodes:
        assert len(n["widgets_values"]) == len(WIDGETS) + len(optional)
        assert [i["name"] for i in n["inputs"] if "widget" in i] == WIDGETS + optional
        kind, opts = info["input"]["required"]["budget_mode"]
        assert n["widgets_values"][1] in (opts["options"] if kind == "COMBO" else kind)  # V3 / V1 combo
        assert "vramcut_plan" not in n.get("properties", {}), "an example must not carry a stale plan"
    ids = {n["id"] for n in wf["nodes"]}
    for link in wf["links"]:
        assert link[1] in ids and link[3] in ids

    # the template browser titles a pack's template by its file name (frontend 1.27 to 1.49 read
    # no locale for them): the name is the title
    assert name.startswith("VRAMCut - ") and "_" not in name, name
    titles = comfy_server.get("/i18n")["en"]["templateWorkflows"]["template"][comfy_server.pack_folder]
    assert titles[name] == name, titles
    notes = " ".join(str(v) for n in wf["nodes"] if n["type"] in ("Note", "MarkdownNote") for v in n["widgets_values"])
    assert "weights only" not in notes and "'estimate'" in notes, notes  # the badge's own word

    listed = comfy_server.get("/workflow_templates")
    assert name in listed.get(comfy_server.pack_folder, []), listed
    served = comfy_server.get(_template_url(comfy_server, name)[len(comfy_server.url):])
    assert served == wf
    assert os.path.isfile(os.path.join(EXAMPLES, name + ".jpg")), "no thumbnail beside the example"


# ------------------------------------------------------------------------------------ browser

READY_JS = """
const [nodeType, timeoutMs, done] = arguments;
const t0 = Date.now();
(function poll() {
  const ok = window.app && window.app.graph && window.LiteGraph &&
    LiteGraph.registered_node_types[nodeType] &&
    (window.app.extensions || []).some((e) => e.name === "vramcut.MaxVRAM");
  if (ok) return done(true);
  if (Date.now() - t0 > timeoutMs) return done(false);
  setTimeout(poll, 200);
})();
"""

# The example's preview shape at TINY_SHAPE (the tiny model's size).
SHAPE_JS = """const shape = app.graph.nodes.find((n) => n.type === "VRAMCutPreviewShape");
  shape.widgets.find((w) => w.name === "width").value = %d;
  shape.widgets.find((w) => w.name === "height").value = %d;""" % TINY_SHAPE

# Load the example from the template route, point it at the tiny model, queue it.
RUN_EXAMPLE_JS = """
const [url, model, budget, done] = arguments;
(async () => {
  const wf = await (await fetch(url)).json();
  await app.loadGraphData(wf);
  const unet = app.graph.nodes.find((n) => n.type === "UNETLoader");
  const cut = app.graph.nodes.find((n) => n.type === "%(node)s");
  unet.widgets.find((w) => w.name === "unet_name").value = model;
  cut.widgets.find((w) => w.name === "max_vram_gb").value = budget;
  %(shape)s
  app.canvas.ds.scale = 1;
  app.canvas.ds.offset = [20, 50];  // the whole example in view, below the tab bar
  app.canvas.setDirty(true, true);
  await app.queuePrompt(0);
  done({id: cut.id});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": NODE_TYPE, "shape": SHAPE_JS}

PLAN_STATE_JS = """
const el = document.querySelector(".vramcut-plan");
if (!el) return null;
const node = app.graph.nodes.find((n) => n.type === "%(node)s");
return {data: {...el.dataset}, width: el.clientWidth, height: el.clientHeight,
        size: node ? [node.size[0], node.size[1]] : null,
        min: node ? node.computeSize() : null,
        stored: !!(node && node.properties && node.properties.vramcut_plan),
        nodeHeight: node ? node.size[1] : null,
        compactHeight: node ? node.vramcutView.contentHeight(el.clientWidth) : null};
""" % {"node": NODE_TYPE}

# Count canvas pixels close to the resident / streamed colours (the drawing itself, read back).
CANVAS_PIXELS_JS = """
const el = document.querySelector(".vramcut-plan");
const c = el.querySelector("canvas");
const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
const hex = (h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16));
const want = {resident: hex(el.dataset.residentColor), streamed: hex(el.dataset.streamedColor)};
const out = {resident: 0, streamed: 0, painted: 0, total: c.width * c.height};
for (let i = 0; i < px.length; i += 4) {
  if (px[i + 3] > 0) out.painted++;
  for (const k of ["resident", "streamed"]) {
    const w = want[k];
    if (Math.abs(px[i] - w[0]) <= %(tol)d && Math.abs(px[i + 1] - w[1]) <= %(tol)d &&
        Math.abs(px[i + 2] - w[2]) <= %(tol)d && px[i + 3] > 200) out[k]++;
  }
}
return out;
""" % {"tol": COLOR_TOLERANCE}


def _wait(browser, what: str, fn, timeout: float = UI_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last state {last!r}; "
                f"console: {_console_errors(browser)}")


def _console_errors(browser) -> list[str]:
    try:
        return [e["message"] for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    except Exception:
        return []


# The graph's node ids, to see when the frontend has finished restoring the last workflow.
GRAPH_IDS_JS = "return app.graph ? app.graph.nodes.map((n) => String(n.id) + n.type).join(',') : null;"


def _open(browser, server, fresh: bool = True):
    """Load the frontend; ``fresh``: without the workflow an earlier test left (the frontend keeps
    the last workflow in the browser's storage and restores it after it is ready)."""
    if fresh:
        browser.get(server.url + "/")
        browser.execute_script("localStorage.clear(); sessionStorage.clear();")
    browser.get(server.url + "/")
    assert browser.execute_async_script(READY_JS, NODE_TYPE, 45000), \
        f"the ComfyUI frontend or the vramcut extension did not load; console: {_console_errors(browser)}"
    # ready once the graph has stopped changing (the restored or default workflow is in)
    last, since = None, time.monotonic()
    deadline = since + 20
    while time.monotonic() < deadline:
        ids = browser.execute_script(GRAPH_IDS_JS)
        if ids != last:
            last, since = ids, time.monotonic()
        elif time.monotonic() - since > 1.0:
            break
        time.sleep(0.1)


def _plan_drawn(browser):
    st = browser.execute_script(PLAN_STATE_JS)
    if st and st["data"].get("hasPlan") == "true" and int(st["data"].get("segments", 0)) > 0 \
            and int(st["data"].get("drawn", 0)) > 0 and st["height"] + 1 >= st["compactHeight"]:
        return st  # drawn, and the node has grown to show it
    return None


def _count_on_screen(png: bytes, hex_color: str) -> int:
    import numpy as np
    from PIL import Image

    want = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    return int((np.abs(px - want) <= COLOR_TOLERANCE).all(axis=-1).sum())


def _save(name: str, png: bytes) -> str:
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, name)
    with open(path, "wb") as f:
        f.write(png)
    print(f"\nscreenshot: {path}")
    return path


def _run_example(browser, server):
    _open(browser, server)
    url = _template_url(server, RUNNABLE_EXAMPLE)
    r = browser.execute_async_script(RUN_EXAMPLE_JS, url, server.tiny_model, server.tiny_budget_gb)
    assert "error" not in r, r["error"]
    return r["id"], _wait(browser, "the traced plan to be drawn", lambda: _traced_plan_drawn(browser))


def _traced_plan_drawn(browser):
    """The example's run drawn to its end: the plan traced at the preview shape (the weights
    estimate the node sends while it patches comes first)."""
    st = _plan_drawn(browser)
    return st if st and st["data"].get("stage") == "traced" else None


ANSWER_RE = re.compile(
    r"^(fits|over budget) · ≥?\d+\.\d+ / \d+\.\d+ GiB \(\d+ %\) · "
    r"(\d+ of \d+ blocks streamed|all \d+ blocks resident) · "
    r"(\+\d+(\.\d+)? (s|ms) / (step|call)( \(estimate\))?|time not measured)$")


def _check_answer_lines(data: dict, server, estimate: bool | None = None) -> list[str]:
    """One answer line per model, in the issue's form; ``estimate`` says which time it must show."""
    lines = data["answers"].split("\n")
    assert len(lines) == int(data["models"]), data
    for line in lines:
        assert ANSWER_RE.match(line), line
        if estimate is True:
            assert line.endswith("(estimate)"), line
        if estimate is False:
            assert "(estimate)" not in line and "not measured" not in line, line
    return lines


def test_plan_drawn_in_browser(comfy_server, browser):
    from selenium.webdriver.common.by import By

    node_id, st = _run_example(browser, comfy_server)
    d = st["data"]
    assert int(d["resident"]) >= 1 and int(d["streamed"]) >= 1, d
    assert int(d["segments"]) == int(d["resident"]) + int(d["streamed"]) + int(d["idle"])
    assert d["stage"] == "traced" and d["models"] == "1", d  # the example previews at a shape
    assert "message" not in d, d
    # the node is at least as big as its content, and wide enough to read
    assert st["size"][1] >= st["min"][1] - 1 and st["width"] >= 300, st
    assert not st["stored"], "the plan was written into the workflow (node.properties)"
    (line,) = _check_answer_lines(d, comfy_server, estimate=True)
    assert line.startswith("fits · ") and f"of {TINY_UNITS} blocks streamed" in line, line
    # compact: the node is no taller than its widgets and the compact plan (no locked minimum)
    assert st["nodeHeight"] <= st["compactHeight"] + WIDGETS_HEIGHT_MAX, st

    px = browser.execute_script(CANVAS_PIXELS_JS)
    assert px["painted"] > 0.05 * px["total"], px
    assert px["resident"] > 100 and px["streamed"] > 100, px

    time.sleep(0.3)  # let LiteGraph paint the frame that positions the widget
    page = browser.get_screenshot_as_png()
    _save("plan_page.png", page)
    element = browser.find_element(By.CSS_SELECTOR, ".vramcut-plan").screenshot_as_png
    _save("plan_widget.png", element)
    # what is on screen, not only in the canvas buffer
    assert _count_on_screen(element, d["residentColor"]) > 100
    assert _count_on_screen(element, d["streamedColor"]) > 100

    errors = [m for m in _console_errors(browser) if "vramcut" in m.lower()]
    assert not errors, errors


# After a page reload: the node, whether the plan was written into the workflow (it must not be)
# and whether the plan is drawn.
RELOADED_JS = """
const node = app.graph.getNodeById(arguments[0]);
return {type: node && node.type, stored: !!(node && node.properties.vramcut_plan),
        drawn: node && node.vramcutView.el.dataset.hasPlan};
"""

LIVE_EVENT_JS = """
const [nodeId, done] = arguments;
(async () => {
  const { api } = await import("/scripts/api.js");
  const node = app.graph.getNodeById(nodeId);
  const payload = JSON.parse(JSON.stringify(node.vramcutView.raw));
  payload.message = "live update from the test";
  payload.models[0].stage = "measured";
  // a node inside a subgraph is addressed by its path; the last part is the node's own id
  const send = (detail) => api.dispatchEvent(new CustomEvent("vramcut.plan", {detail}));
  send({node: "99:" + nodeId, payload});
  send({node: String(nodeId) + "0", payload: {models: []}});
  done(true);
})().catch((e) => done({error: String(e && e.stack || e)}));
"""


def test_plan_survives_reload_and_follows_live_events(comfy_server, browser):
    node_id, before = _run_example(browser, comfy_server)

    time.sleep(1.5)  # the open workflows are kept in the browser's storage
    _open(browser, comfy_server, fresh=False)  # the page reloaded: the same tab, the run's own
    r = browser.execute_script(RELOADED_JS, node_id)
    assert r and r["type"] == NODE_TYPE and not r["stored"], r
    after = _wait(browser, "the plan after reload", lambda: _plan_drawn(browser))
    for k in ("segments", "resident", "streamed", "stage"):
        assert after["data"][k] == before["data"][k], (k, before, after)

    r = browser.execute_async_script(LIVE_EVENT_JS, node_id)
    assert r is True, r
    live = _wait(browser, "the live event to be shown",
                 lambda: (s := browser.execute_script(PLAN_STATE_JS)) and s["data"].get("message") and s)
    assert live["data"]["message"] == "live update from the test"
    assert live["data"]["stage"] == "measured"
    assert live["data"]["segments"] == before["data"]["segments"]  # the event for node "<id>0" was ignored
    _save("plan_live_message.png", browser.get_screenshot_as_png())


def test_decode_updates_the_plan_with_measured_shapes_in_history(comfy_server):
    """A VAE decode through the node: the node runs first (weights-only plan), the decode then
    measures the real shapes and the live update lands in the node's output in /history."""
    s = comfy_server
    prompt = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": s.sd_vae}},
        "2": {"class_type": NODE_TYPE, "inputs": {
            "max_vram_gb": 0.08, "budget_mode": "fixed", "reserve_gb": 1.0, "prefetch": True,
            "residency": True, "vae": ["1", 0]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["2", 2]}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["4", 0]}},
    }
    r = s.post("/prompt", {"prompt": prompt, "client_id": "vramcut-test"})
    assert not r.get("node_errors"), r
    entry = _wait_history(s, r["prompt_id"])
    assert entry["status"]["status_str"] == "success", (entry["status"], s.log_tail())
    (payload,) = entry["outputs"]["2"]["vramcut"]
    (vae,) = payload["models"]
    assert vae["kind"] == "VAE" and vae["stage"] == "measured", vae["text"]
    assert vae["signature"] and "1x4x8x8" in vae["signature"]
    plan = vae["plan"]
    assert plan["measured"] and plan["activation_reserve_bytes"] > 0
    assert plan["peak_bytes"] <= plan["budget_bytes"] == int(0.08 * 1024**3)
    assert plan["streamed_bytes_per_forward"] > 0
    assert any(not s["idle"] for s in plan["segments"]) and any(s["idle"] for s in plan["segments"]), \
        "a decode never runs the encoder: its units are idle"
    assert "images" in entry["outputs"]["5"]


# ------------------------------------------------------------- a real VAE decode in the browser

# Colours the extension draws with (web/plan/theme.js COLORS; the element's dataset names the
# plan's four fills too).
RESIDENT_COLOR = "#0072b2"
STREAMED_COLOR = "#e69f00"
ACTIVATION_COLOR = "#56b4e9"
IDLE_COLOR = "#6b7280"
MEASURED_BADGE = "#16a34a"
WEIGHTS_BADGE = "#64748b"
BADGE_TOLERANCE = 3          # the badges are flat fills; idle (#6b7280) is 11 away from #64748b
# Measured on the random SD VAE decoding a 1x4x8x8 latent, prefetch off (one slot): decoder.up.3
# (63 MiB) stays resident, the rest of the decoder streams in 3 transfers, the encoder is idle;
# that plan holds from 0.13 GiB to 0.19 GiB (all resident). With prefetch on no budget keeps a
# block resident while others stream: one resident 63 MiB block, two 63 MiB slots and 10 MiB of
# activations already take what the whole decoder resident takes.
VAE_BUDGET_GB = 0.16
DOCS_IMAGE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", "node_plan.png")
DOCS_ZOOM = 1.5
DOCS_WIDTH = 360             # graph units: the node's default width

# Build VAELoader -> Max VRAM -> VAEDecode(EmptyLatentImage 64x64) -> PreviewImage in the page,
# log what reaches the page (api events and every data-stage the node's plan element takes).
BUILD_VAE_GRAPH_JS = """
const [vaeName, budget, firstId, done] = arguments;
(async () => {
  const { api } = await import("/scripts/api.js");
  app.graph.clear();
  // Ids no other prompt of this module uses: the server addresses plan events by node id
  // alone, and a model that an earlier prompt patched reports its plan again when ComfyUI
  // unloads it, whenever that is.
  let nextId = firstId;
  const add = (type, pos, values = {}) => {
    const n = LiteGraph.createNode(type);
    if (!n) throw new Error("cannot create " + type);
    n.id = nextId++;
    n.pos = pos;
    app.graph.add(n);
    // newer frontends may hand the id back as a string: compare the values, not the types
    if (String(n.id) !== String(nextId - 1)) throw new Error(`${type} got id ${n.id}, not ${nextId - 1}`);
    for (const [k, v] of Object.entries(values)) {
      const w = n.widgets.find((w) => w.name === k);
      if (!w) throw new Error(type + " has no widget " + k);
      w.value = v;
    }
    return n;
  };
  const link = (a, out, b, inp) => {
    const o = a.findOutputSlot(out), i = b.findInputSlot(inp);
    if (o < 0 || i < 0 || !a.connect(o, b, i)) throw new Error(`cannot link ${a.type}.${out} -> ${b.type}.${inp}`);
  };
  const loader = add("VAELoader", [20, 90], {vae_name: vaeName});
  const cut = add("%(node)s", [340, 90], {max_vram_gb: budget, budget_mode: "fixed", reserve_gb: 1.0,
                                          prefetch: false, residency: true});
  const latent = add("EmptyLatentImage", [20, 260], {width: 64, height: 64, batch_size: 1});
  const decode = add("VAEDecode", [880, 90]);
  const preview = add("PreviewImage", [880, 230]);
  link(loader, "VAE", cut, "vae");
  link(cut, "vae", decode, "vae");
  link(latent, "LATENT", decode, "samples");
  link(decode, "IMAGE", preview, "images");

  const log = window.__vramcutLog = {events: [], stages: [cut.vramcutView.el.dataset.stage]};
  const stages = (p) => (p && p.models || []).map((m) => m.stage).join(",");
  api.addEventListener("vramcut.plan", (e) => log.events.push(
    {type: "vramcut.plan", node: String(e.detail.node), stages: stages(e.detail.payload)}));
  api.addEventListener("executed", (e) => {
    const p = e.detail.output && e.detail.output.vramcut;
    log.events.push({type: "executed", node: String(e.detail.node),
                     stages: p ? stages(p[p.length - 1]) : null});
  });
  for (const type of ["execution_start", "execution_cached", "execution_success", "execution_error",
                      "execution_interrupted"])
    api.addEventListener(type, (e) => log.events.push({type, prompt_id: e.detail.prompt_id,
                                                      nodes: e.detail.nodes}));
  new MutationObserver(() => log.stages.push(cut.vramcutView.el.dataset.stage))
    .observe(cut.vramcutView.el, {attributes: true, attributeFilter: ["data-stage"]});

  app.canvas.ds.scale = 1;
  app.canvas.ds.offset = [0, 0];
  app.canvas.setDirty(true, true);
  done({cut: cut.id, decode: decode.id, preview: preview.id});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": NODE_TYPE}

# Mute (mode 2: left out of the prompt) or unmute the decode branch, then queue the graph.
QUEUE_JS = """
const [ids, mode, done] = arguments;
(async () => {
  for (const id of ids) app.graph.getNodeById(id).mode = mode;
  const log = window.__vramcutLog;
  log.events.length = 0;
  log.stages = [log.stages[log.stages.length - 1]];
  await app.queuePrompt(0);
  done(true);
})().catch((e) => done({error: String(e && e.stack || e)}));
"""

NODE_STATE_JS = """
const [nodeId] = arguments;
const node = app.graph.getNodeById(nodeId);
const el = node && node.vramcutView && node.vramcutView.el;
if (!el) return null;
const stored = node.properties && node.properties.vramcut_plan;
const shown = node.vramcutView.payload;
return {data: {...el.dataset}, text: node.vramcutView.pre.textContent,
        labels: shown ? shown.models.map((m) => m.label) : [],
        stored: stored ? stored.models.map((m) => m.stage).join(",") : null,
        log: window.__vramcutLog};
"""

# Count canvas pixels near each colour; arguments: node id, {name: [hex, tolerance]}.
NODE_PIXELS_JS = """
const [nodeId, want] = arguments;
const c = app.graph.getNodeById(nodeId).vramcutView.canvas;
const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
const hex = (h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16));
const ws = Object.entries(want).map(([k, [h, tol]]) => [k, hex(h), tol]);
const out = {total: c.width * c.height};
for (const [k] of ws) out[k] = 0;
for (let i = 0; i < px.length; i += 4) {
  if (px[i + 3] <= 200) continue;
  for (const [k, w, tol] of ws)
    if (Math.abs(px[i] - w[0]) <= tol && Math.abs(px[i + 1] - w[1]) <= tol && Math.abs(px[i + 2] - w[2]) <= tol) out[k]++;
}
return out;
"""

# Zoom / pan the graph so the node sits at (x, y) on the canvas, optionally at another width (the
# height then fits the plan) and with the links hidden; resolves once the plan has been redrawn
# at the new size and pixel scale, with the node's box (title included) in page pixels.
FRAME_NODE_JS = """
const [nodeId, scale, x, y, width, hideLinks, done] = arguments;
const node = app.graph.getNodeById(nodeId);
const view = node.vramcutView;
const drawn = () => Number(view.el.dataset.drawn || 0);
const before = drawn();
if (width) {
  node.setSize([width, node.size[1]]);
  node.vramcutFit({shrink: true});  // the height that shows the whole plan
}
if (hideLinks !== null) app.canvas.links_render_mode = hideLinks ? LiteGraph.HIDDEN_LINK : LiteGraph.SPLINE_LINK;
const ds = app.canvas.ds;
ds.scale = scale;
ds.offset = [x / scale - node.pos[0], y / scale - node.pos[1] + LiteGraph.NODE_TITLE_HEIGHT];
app.canvas.setDirty(true, true);
const t0 = Date.now();
(function wait() {
  const settled = Math.abs(view.drawnScale - view.pixelScale()) < 0.01 && !view.frame &&
    (!width || drawn() > before) && view.el.clientWidth > 0;
  if (!settled && Date.now() - t0 < 10000) return requestAnimationFrame(wait);
  requestAnimationFrame(() => requestAnimationFrame(() => {
    const r = app.canvas.canvas.getBoundingClientRect();
    const th = LiteGraph.NODE_TITLE_HEIGHT;
    done({settled, left: r.left + (node.pos[0] + ds.offset[0]) * ds.scale,
          top: r.top + (node.pos[1] - th + ds.offset[1]) * ds.scale,
          width: node.size[0] * ds.scale, height: (node.size[1] + th) * ds.scale,
          fits: view.el.clientHeight + 1 >= view.contentHeight(view.el.clientWidth)});
  }));
})();
"""


def _node_state(browser, node_id):
    return browser.execute_script(NODE_STATE_JS, node_id)


def _wait_run(browser, server, node_id, stage: str, grace_s: float = 10.0):
    """Until the queued prompt has finished and the node's plan is drawn at ``stage`` (at most
    ``grace_s`` after the run's end: the plan is drawn while the run goes on)."""
    finished = []

    def ready():
        st = _node_state(browser, node_id)
        if not st:
            return None
        types = [e["type"] for e in st["log"]["events"]]
        if "execution_error" in types or "execution_interrupted" in types:
            pytest.fail(f"the run failed: {st['log']['events']}\n{server.log_tail()}")
        d = st["data"]
        if "execution_success" in types:
            if d.get("stage") == stage and int(d.get("drawn", 0)) > 0:
                return st
            finished.append(time.monotonic())
            if finished[-1] - finished[0] > grace_s:
                pytest.fail(f"the run finished but the node shows stage {d.get('stage')!r}, not {stage!r}: "
                            f"{d}\n{st['log']}")
        return None
    return _wait(browser, f"the run to finish with a {stage!r} plan drawn", ready, timeout=PROMPT_TIMEOUT_S)


def _node_crop(browser, node_id, scale, width=None, hide_links=None, pad=8, at=(100, 90)):
    """PNG of the node (title, widgets and plan) cut out of a page screenshot; ``at``: where on
    the page the node's top left goes (the default is clear of the sidebar)."""
    from PIL import Image

    box = browser.execute_async_script(FRAME_NODE_JS, node_id, scale, at[0], at[1], width, hide_links)
    assert box["settled"] and box["fits"], ("the plan was not redrawn at the new size / zoom", box)
    page = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    l, t = max(0, int(box["left"]) - pad), max(0, int(box["top"]) - pad)
    r = min(page.width, int(box["left"] + box["width"]) + pad + 1)
    b = min(page.height, int(box["top"] + box["height"]) + pad + 1)
    assert r - l > 0.9 * box["width"] and b - t > 0.9 * box["height"], (box, page.size)
    out = io.BytesIO()
    page.crop((l, t, r, b)).save(out, "PNG", optimize=True)
    return out.getvalue()


def test_live_measured_plan_is_drawn_during_a_real_run(comfy_server, browser):
    """The VAE decode graph built in the page and queued twice: first with the decode muted, so
    the node shows the weights-only plan; then whole, so the decode measures the real shapes and
    the node redraws with the measured plan (activations, idle encoder) without a reload."""
    s = comfy_server
    _open(browser, s)
    ids = browser.execute_async_script(BUILD_VAE_GRAPH_JS, s.sd_vae, VAE_BUDGET_GB, 701)
    assert "error" not in ids, ids["error"]
    cut, branch = ids["cut"], [ids["decode"], ids["preview"]]
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutSetDetails(true)", cut)  # every segment drawn
    colors = {"resident": (RESIDENT_COLOR, COLOR_TOLERANCE), "streamed": (STREAMED_COLOR, COLOR_TOLERANCE),
              "activation": (ACTIVATION_COLOR, COLOR_TOLERANCE), "idle": (IDLE_COLOR, BADGE_TOLERANCE),
              "measured_badge": (MEASURED_BADGE, BADGE_TOLERANCE),
              "weights_badge": (WEIGHTS_BADGE, BADGE_TOLERANCE)}

    # 1. Decode muted: the node runs alone and can only know the weights.
    assert browser.execute_async_script(QUEUE_JS, branch, 2) is True
    st = _wait_run(browser, s, cut, "weights")
    d = st["data"]
    assert d["stages"] == "weights" and d["idle"] == "0" and int(d["streamed"]) >= 1, d
    px = browser.execute_script(NODE_PIXELS_JS, cut, colors)
    # no activations drawn but the legend's 10x10 swatch
    assert px["weights_badge"] > 200 and px["measured_badge"] == 0 and px["activation"] <= 100, px
    _check_answer_lines(d, s, estimate=True)
    weights_px = px
    _save("vae_weights_node.png", _node_crop(browser, cut, 1.0))

    # 2. The whole graph: the Max VRAM node is cached, the decode measures and sends the plan.
    assert browser.execute_async_script(QUEUE_JS, branch, 0) is True
    st = _wait_run(browser, s, cut, "measured")
    d, log = st["data"], st["log"]
    assert d["stages"] == "measured" and d["models"] == "1" and "message" not in d, d
    _check_answer_lines(d, s)  # one decode is the measuring pass: its time is not the plan's (an estimate until a call runs the plan)
    assert int(d["resident"]) >= 1 and int(d["streamed"]) >= 1 and int(d["idle"]) >= 1, d
    assert int(d["segments"]) == int(d["resident"]) + int(d["streamed"]) + int(d["idle"]), d
    (label,) = st["labels"]
    assert label.startswith("VAE"), label
    # the table names the input as a user knows it (the latent's size), not the engine's "arg0 1x4x8x8"
    for part in ("decoder.up.3", "encoder.mid", "idle", "measured:", "latent 8×8, batch 1"):
        assert part in st["text"], (part, st["text"])
    assert st["stored"] is None, "the plan was written into the workflow (node.properties)"
    # during this run the node was drawn as weights, then measured, never back; the measured
    # plan came from the server's live event ("executed" carries it too once the decode mutated
    # the node's output, but the cached node's "executed" comes before the decode)
    stages = [x for i, x in enumerate(log["stages"]) if i == 0 or x != log["stages"][i - 1]]
    assert stages == ["weights", "measured"], log
    live = [e for e in log["events"] if e["type"] == "vramcut.plan" and e["node"].split(":")[-1] == str(cut)]
    assert any(e["stages"] == "measured" for e in live), log["events"]
    # ... while the graph was still running: before the preview (the last node) finished
    first_measured = next(i for i, e in enumerate(log["events"]) if e.get("stages") == "measured")
    preview_done = next(i for i, e in enumerate(log["events"])
                        if e["type"] == "executed" and e["node"] == str(ids["preview"]))
    assert first_measured < preview_done, log["events"]

    # what the page drew is what the server ended the run with
    prompt_id = next(e["prompt_id"] for e in log["events"] if e["type"] == "execution_start")
    (payload,) = s.get(f"/history/{prompt_id}")[prompt_id]["outputs"][str(cut)]["vramcut"]
    (vae,) = payload["models"]
    segs = vae["plan"]["segments"]
    assert vae["kind"] == "VAE" and vae["stage"] == "measured", vae["text"]
    assert (int(d["segments"]), int(d["resident"]), int(d["idle"])) == (
        len(segs), sum(x["resident"] for x in segs), sum(bool(x["idle"]) and not x["resident"] for x in segs))

    px = browser.execute_script(NODE_PIXELS_JS, cut, colors)
    assert px["measured_badge"] > 200 and px["weights_badge"] == 0, px
    for k in ("resident", "streamed", "idle"):
        assert px[k] > 50, (k, px)
    assert px["activation"] > weights_px["activation"] + 100, (px, weights_px)  # bars, not the legend

    time.sleep(0.3)  # the frame that positions the DOM widget
    node_png = _node_crop(browser, cut, 1.0)
    _save("vae_measured_node.png", node_png)
    for k in ("resident", "streamed", "activation"):  # on screen, not only in the buffer
        assert _count_on_screen(node_png, colors[k][0]) > 50, k

    # as in the README picture: the default width, larger, no wires running into the crop
    _save("node_plan.png", _node_crop(browser, cut, DOCS_ZOOM, width=DOCS_WIDTH, hide_links=True))

    errors = [m for m in _console_errors(browser) if "vramcut" in m.lower()]
    assert not errors, errors


# ------------------------------------------------- the node in use: save state, warnings, theme, zoom

# The change tracker of the open workflow (what draws the "unsaved" dot and keeps the undo steps).
TRACKER_JS = """
const [nodeId, save] = arguments;
const wf = app.extensionManager && app.extensionManager.workflow && app.extensionManager.workflow.activeWorkflow;
const ct = wf && wf.changeTracker;
if (!ct) return {error: "no change tracker on app.extensionManager.workflow.activeWorkflow"};
if (typeof ct.captureCanvasState === "function") ct.captureCanvasState(); else ct.checkState();
if (save) {  // what saving does to the tracker: the current state becomes the saved one
  ct.reset();
  wf.isModified = false;
}
const node = app.graph.getNodeById(nodeId);
return {modified: !!wf.isModified, undo: ct.undoQueue.length, size: [node.size[0], node.size[1]],
        properties: Object.keys(node.properties || {})};
"""


def test_a_run_leaves_a_saved_workflow_unchanged(comfy_server, browser):
    """Saved after a run, run again with no edit (the server's cache cleared, so everything
    really runs and the node gets its live plans again): not marked changed, no undo steps."""
    s = comfy_server
    _open(browser, s)
    ids = browser.execute_async_script(BUILD_VAE_GRAPH_JS, s.sd_vae, VAE_BUDGET_GB, 801)
    assert "error" not in ids, ids["error"]
    cut, branch = ids["cut"], [ids["decode"], ids["preview"]]
    assert browser.execute_async_script(QUEUE_JS, branch, 0) is True
    _wait_run(browser, s, cut, "measured")
    # the preview node grows once its image has loaded (the host's own change): let it settle first
    _wait(browser, "the preview image", lambda: browser.execute_script(
        "const n = app.graph.getNodeById(arguments[0]); return !!(n.imgs && n.imgs.length)", ids["preview"]))
    time.sleep(1.0)
    saved = browser.execute_script(TRACKER_JS, cut, True)
    assert "error" not in saved, saved

    import urllib.request  # /free answers with an empty body
    for _ in range(3):
        req = urllib.request.Request(s.url + "/free", data=json.dumps({"free_memory": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()  # the next prompt runs every node again
        # the prompt worker takes the flag when it wakes; a prompt queued before it has can run
        # first, from the cache (no live plan: seen twice on 0.3.64 under load, once after a 2 s
        # wait): then the flag is taken after that run, and the same unchanged run is queued again
        time.sleep(2.0)
        assert browser.execute_async_script(QUEUE_JS, branch, 0) is True
        st = _wait_run(browser, s, cut, "measured")
        live = [e for e in st["log"]["events"] if e["type"] == "vramcut.plan"
                and e["node"].split(":")[-1] == str(cut)]
        if live:
            break
    assert live, ("the second run sent no live plan: it did not really run", st["log"]["events"])
    _check_answer_lines(st["data"], s, estimate=None)
    after = browser.execute_script(TRACKER_JS, cut, False)
    assert not after["modified"], (saved, after)
    assert after["undo"] == saved["undo"] and after["size"] == saved["size"], (saved, after)
    assert "vramcut_plan" not in after["properties"], after


SHRINK_JS = """
const [nodeId] = arguments;
const node = app.graph.getNodeById(nodeId);
node.setSize([node.size[0], node.computeSize()[1]]);  // as small as the host lets a node be
node.vramcutShow(node.vramcutView.raw);  // the same plan again, as the next run sends it
app.canvas.setDirty(true, true);
return node.size[1];
"""

NODE_SIZE_JS = """
const node = app.graph.getNodeById(arguments[0]);
const v = node.vramcutView;
return {size: [node.size[0], node.size[1]], details: v.el.dataset.details,
        compact: v.contentHeight(v.el.clientWidth || node.size[0] - 12),
        fits: v.el.clientHeight > 0 && v.el.clientHeight + 1 >= v.contentHeight(v.el.clientWidth)};
"""


def test_node_is_compact_and_can_be_shrunk(comfy_server, browser):
    """Compact by default; the details button grows it and "less" brings it back; a height the
    user chose is kept when the next plan arrives (no locked minimum, no snapping back)."""
    from selenium.webdriver.common.by import By

    s = comfy_server
    node_id, _ = _run_example(browser, s)
    compact = _wait(browser, "the node to fit its plan", lambda: (
        (z := browser.execute_script(NODE_SIZE_JS, node_id))["fits"] and z))
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-details").click()
    grown = _wait(browser, "the details to open", lambda: (
        (z := browser.execute_script(NODE_SIZE_JS, node_id))["details"] == "true" and z["size"][1] > compact["size"][1] + 20 and z))
    _save("plan_details.png", browser.find_element(By.CSS_SELECTOR, ".vramcut-plan").screenshot_as_png)
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-details").click()
    back = _wait(browser, "the details to close", lambda: (
        (z := browser.execute_script(NODE_SIZE_JS, node_id))["details"] == "false" and z["size"][1] < grown["size"][1] and z))
    assert abs(back["size"][1] - compact["size"][1]) <= 2, (compact, grown, back)

    small = browser.execute_script(SHRINK_JS, node_id)
    # the plan holds no minimum: the node goes down to its other widgets and the header row
    assert small < compact["size"][1] - compact["compact"] + 2 * MIN_PLAN_ROW, (small, compact)
    time.sleep(0.5)  # a few frames: nothing may snap it back
    assert browser.execute_script(NODE_SIZE_JS, node_id)["size"][1] == small


UNUSED_JS = """
const [loaderId, cutId, decodeId, bypass] = arguments;
const loader = app.graph.getNodeById(loaderId), cut = app.graph.getNodeById(cutId), decode = app.graph.getNodeById(decodeId);
const from = bypass ? loader : cut;
if (!from.connect(from.findOutputSlot("VAE") >= 0 ? from.findOutputSlot("VAE") : from.findOutputSlot("vae"), decode, decode.findInputSlot("vae")))
  return {error: "cannot link"};
app.canvas.setDirty(true, true);
return true;
"""


def test_unused_output_is_warned_on_the_node(comfy_server, browser):
    """The decode fed straight from the loader: the node's VAE output leads nowhere, and it says so."""
    s = comfy_server
    _open(browser, s)
    ids = browser.execute_async_script(BUILD_VAE_GRAPH_JS, s.sd_vae, VAE_BUDGET_GB, 901)
    assert "error" not in ids, ids["error"]
    cut = ids["cut"]
    loader = str(int(cut) - 1)  # ids come back as strings from newer frontends
    state = lambda: browser.execute_script(NODE_STATE_JS, cut)["data"]  # noqa: E731
    assert state().get("unused", "") == ""
    assert browser.execute_script(UNUSED_JS, loader, cut, ids["decode"], True) is True
    _wait(browser, "the unused-output warning", lambda: (d := state()).get("unused") == "VAE" and d)
    warn = {"warning": ("#facc15", COLOR_TOLERANCE)}
    _wait(browser, "the warning to be drawn", lambda: browser.execute_script(NODE_PIXELS_JS, cut, warn)["warning"] > 100)
    time.sleep(0.3)
    _save("unused_output_node.png", _node_crop(browser, cut, 1.0))
    assert browser.execute_script(UNUSED_JS, loader, cut, ids["decode"], False) is True
    _wait(browser, "the warning to go", lambda: state().get("unused") == "")


THEME_JS = """
const [palette, done] = arguments;
(async () => {
  const store = app.extensionManager && app.extensionManager.setting;
  if (store && store.set) await store.set("Comfy.ColorPalette", palette);
  else await app.ui.settings.setSettingValueAsync("Comfy.ColorPalette", palette);
  done(true);
})().catch((e) => done({error: String(e && e.stack || e)}));
"""

THEME_STATE_JS = """
const node = app.graph.getNodeById(arguments[0]);
const css = getComputedStyle(document.documentElement);
return {fg: css.getPropertyValue("--input-text").trim(), drawnFg: node.vramcutView.el.dataset.fg,
        drawn: Number(node.vramcutView.el.dataset.drawn || 0)};
"""


def test_theme_switch_redraws_the_plan(comfy_server, browser):
    s = comfy_server
    node_id, _ = _run_example(browser, s)
    before = browser.execute_script(THEME_STATE_JS, node_id)
    assert before["drawnFg"] == before["fg"], before
    try:
        assert browser.execute_async_script(THEME_JS, "light") is True
        after = _wait(browser, "the plan redrawn in the light palette", lambda: (
            (t := browser.execute_script(THEME_STATE_JS, node_id))["fg"] != before["fg"]
            and t["drawnFg"] == t["fg"] and t["drawn"] > before["drawn"] and t))
        time.sleep(0.3)
        _save("plan_light_theme.png", _node_crop(browser, node_id, 1.0))
        assert after["drawnFg"] != before["drawnFg"]
    finally:
        browser.execute_async_script(THEME_JS, "dark")


ZOOM_JS = """
const [nodeId, scale, collapse] = arguments;
const node = app.graph.getNodeById(nodeId);
app.canvas.ds.scale = scale;
app.canvas.ds.offset = [100 / scale - node.pos[0], 90 / scale - node.pos[1]];
if (!!node.flags.collapsed !== collapse) node.collapse();
app.canvas.setDirty(true, true);
const el = node.vramcutView.el;
return {zoomed: el.dataset.zoomed, title: node.getTitle(), frame: node.vramcutView.frame};
"""


def test_zoomed_out_and_collapsed_the_answer_stays(comfy_server, browser):
    s = comfy_server
    node_id, st = _run_example(browser, s)
    fits = {"fits": ("#22c55e", COLOR_TOLERANCE)}
    browser.execute_script(ZOOM_JS, node_id, 0.5, False)
    _wait(browser, "the zoomed-out answer", lambda: (
        browser.execute_script(ZOOM_JS, node_id, 0.5, False)["zoomed"] == "out"
        and browser.execute_script(NODE_PIXELS_JS, node_id, fits)["fits"] > 50))
    time.sleep(0.3)
    _save("plan_zoomed_out.png", browser.get_screenshot_as_png())
    # at 70 % the plan is drawn at screen resolution (one canvas pixel per screen pixel)
    browser.execute_script(ZOOM_JS, node_id, 0.7, False)
    _wait(browser, "the plan redrawn at 70 %", lambda: browser.execute_script(
        "const v = app.graph.getNodeById(arguments[0]).vramcutView;"
        "return v.el.dataset.zoomed === 'in' && v.canvas.width === Math.round(v.el.clientWidth * 0.7)", node_id))
    time.sleep(0.3)
    _save("plan_zoom70.png", browser.get_screenshot_as_png())
    z = browser.execute_script(ZOOM_JS, node_id, 1.0, True)
    assert " · fits " in z["title"] and "%" in z["title"], z
    time.sleep(0.3)
    _save("plan_collapsed.png", browser.get_screenshot_as_png())
    browser.execute_script(ZOOM_JS, node_id, 1.0, False)


POINT_JS = """
const el = document.querySelector(".vramcut-plan canvas");
const r = el.getBoundingClientRect();
const x = r.left + r.width / 2, y = r.top + r.height - 8;
const hit = document.elementFromPoint(x, y);
const node = app.graph.nodes.find((n) => n.vramcutView);
return {x, y, onCanvas: hit === app.canvas.canvas, hit: hit && (hit.className || hit.tagName),
        pos: [node.pos[0], node.pos[1]], scale: app.canvas.ds.scale};
"""


TIP_TARGET_JS = """
const node = app.graph.nodes.find((n) => n.vramcutView);
const v = node.vramcutView;
const g = v.regions.find((r) => !r.section && /Bandwidth/.test(r.tip));
const rect = v.canvas.getBoundingClientRect();
const k = rect.width / v.el.clientWidth;
return g ? {x: rect.left + (g.x + g.w / 2) * k, y: rect.top + (g.y + g.h / 2) * k} : null;
"""

TIP_STATE_JS = """
const t = document.querySelector(".vramcut-tip");
if (!t || t.style.display === "none") return null;
const cs = getComputedStyle(t);
return {text: t.textContent, font: cs.fontFamily, size: cs.fontSize};
"""


def test_hover_shows_a_short_styled_tooltip(comfy_server, browser):
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    _run_example(browser, comfy_server)
    at = browser.execute_script(TIP_TARGET_JS)
    assert at, "no region with the cost explanation"
    actions = ActionBuilder(browser)
    actions.pointer_action.move_to_location(int(at["x"]), int(at["y"]))
    actions.perform()
    tip = _wait(browser, "the tooltip", lambda: browser.execute_script(TIP_STATE_JS))
    assert "bandwidth" in tip["text"].lower() and len(tip["text"].splitlines()) <= 4, tip
    assert "mono" not in tip["font"].lower() and tip["size"] == "12px", tip


def test_budget_too_small_says_which_budget_works(comfy_server, browser):
    """The error on the node offers the fix: a max_vram_gb that is large enough."""
    s = comfy_server
    _open(browser, s)
    url = _template_url(s, RUNNABLE_EXAMPLE)
    r = browser.execute_async_script(RUN_EXAMPLE_JS, url, s.tiny_model, 0.001)
    assert "error" not in r, r["error"]
    st = _wait(browser, "the budget error on the node", lambda: (
        (x := browser.execute_script(PLAN_STATE_JS)) and x["data"].get("message") and x))
    view = browser.execute_script(
        "const n = app.graph.getNodeById(arguments[0]); return n.vramcutView.payload", r["id"])
    need = view.get("min_budget_bytes") or view.get("need_bytes")
    assert need and need > 0.001 * 1024**3, (view, st)
    m = re.match(r"Set max_vram_gb (to|to at least|above) (\d+\.\d+)", st["data"].get("fix", ""))
    assert m and float(m.group(2)) * 1024**3 >= need, (st["data"], need)
    time.sleep(0.3)
    _save("budget_error_node.png", _node_crop(browser, r["id"], 1.0))


def test_drag_on_the_plan_moves_the_node(comfy_server, browser):
    """Dragging on the plan moves the node; a right-click on it opens the node's context menu."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    s = comfy_server
    _run_example(browser, s)
    p = browser.execute_script(POINT_JS)
    actions = ActionBuilder(browser)
    actions.pointer_action.move_to_location(int(p["x"]), int(p["y"])).pointer_down()
    actions.pointer_action.move_to_location(int(p["x"]) + 40, int(p["y"]) + 20)
    actions.pointer_action.move_to_location(int(p["x"]) + 80, int(p["y"]) + 40).pointer_up()
    actions.perform()
    q = browser.execute_script(POINT_JS)
    moved = [(q["pos"][i] - p["pos"][i]) * p["scale"] for i in (0, 1)]
    assert abs(moved[0] - 80) <= 4 and abs(moved[1] - 40) <= 4, (p, q)
    deprecated = [e["message"] for e in browser.get_log("browser") if "checkState() is deprecated" in e["message"]]
    assert not deprecated, deprecated

    actions = ActionBuilder(browser)
    actions.pointer_action.move_to_location(int(q["x"]), int(q["y"])).context_click()
    actions.perform()
    menu = _wait(browser, "the node's context menu", lambda: browser.execute_script(
        "return [...document.querySelectorAll('.litecontextmenu')].map((e) => e.textContent).join(' | ')"))
    assert "Properties" in menu, menu  # the node's menu, not the canvas's
    ActionChains(browser).send_keys("\ue00c").perform()  # Escape


# ------------------------------------------------------ what a user sees: refusal, first look, collapse

FITS_COLOR = "#22c55e"      # web/plan/theme.js COLORS.fits (the "fits" verdict, dark palette)
OVER_COLOR = "#ef4444"      # COLORS.over: "over budget" / "refused"
REFUSED_BUDGET_GB = 0.05    # the random SD VAE decoding a 512x512 image: its activations need ~0.056


def _wait_events(browser, node_id, *types, timeout=PROMPT_TIMEOUT_S):
    """Until the build log holds one of ``types`` (the run's end); returns the node's state."""
    return _wait(browser, f"one of {types}", lambda: (
        (st := _node_state(browser, node_id)) and any(e["type"] in types for e in st["log"]["events"]) and st),
        timeout=timeout)


def _close_error_dialog(browser):
    """Older frontends answer a failed run with a modal dialog over the graph: close it."""
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).send_keys("\ue00c").perform()  # Escape
    time.sleep(0.3)
    browser.execute_script("document.querySelectorAll('.p-dialog-mask').forEach((e) => e.remove())")


def test_refusal_is_the_node_state(comfy_server, browser):
    """A decode the budget cannot hold: the node shows the refusal, not the estimate drawn before
    the run (no green "fits" anywhere on it), and leads with the fix, the number the error names."""
    s = comfy_server
    _open(browser, s)
    ids = browser.execute_async_script(BUILD_VAE_GRAPH_JS, s.sd_vae, REFUSED_BUDGET_GB, 1101)
    assert "error" not in ids, ids["error"]
    cut = ids["cut"]
    browser.execute_script("const n = app.graph.nodes.find((n) => n.type === 'EmptyLatentImage');"
                           "n.widgets[0].value = 512; n.widgets[1].value = 512;")
    assert browser.execute_async_script(QUEUE_JS, [ids["decode"], ids["preview"]], 0) is True
    st = _wait_events(browser, cut, "execution_error", "execution_success")
    assert any(e["type"] == "execution_error" for e in st["log"]["events"]), "the decode was not refused"
    d = _wait(browser, "the refusal drawn", lambda: (
        (x := _node_state(browser, cut)["data"]).get("state") == "refused" and int(x.get("drawn", 0)) > 0 and x))
    fix = re.match(r"Set max_vram_gb (to|to at least|above) (\d+\.\d+)\.$", d.get("fix", ""))
    assert fix, d
    # one number: the error's own text names the same budget, and says "at least" only when it does
    named = re.findall(r"max_vram_gb that works for this shape is (?:at least |about )?(\d+\.\d+)", d["message"])
    assert not named or named == [fix.group(2)], (d["fix"], d["message"])
    exact = "the smallest max_vram_gb that works for this shape is" in d["message"]
    assert exact, d["message"]   # a traced VAE decode: the smallest budget, not a lower bound
    assert fix.group(1) == "to", f"the fix says {fix.group(1)!r} where the message names the smallest budget"
    (line,) = d["answers"].split("\n")
    assert line.startswith(f"refused · needs {fix.group(2)} / "), line
    _close_error_dialog(browser)
    time.sleep(0.3)
    png = _node_crop(browser, cut, 1.0)
    _save("refused_node.png", png)
    # on screen: no "fits" verdict left, the refusal in red
    assert _count_on_screen(png, FITS_COLOR) == 0, "the pre-run estimate is still drawn as fitting"
    assert _count_on_screen(png, OVER_COLOR) > 300


ADDED_NODE_JS = """
const n = app.graph.nodes.find((n) => n.type === arguments[0]);
if (!n) return null;
const v = n.vramcutView;
const r = v.el.getBoundingClientRect();
return {area: v.el.clientHeight, content: v.contentHeight(v.el.clientWidth), box: [r.left, r.top, r.width, r.height],
        size: [n.size[0], n.size[1]], id: n.id};
"""


def test_node_added_from_search_shows_its_guidance(comfy_server, browser):
    """Added from the search box (double-click, type, Enter) as a user adds it: the plan area is
    as tall as its content, so "VRAM plan" and the "Queue the workflow…" hint are on screen."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    _open(browser, comfy_server)
    browser.execute_script("app.graph.clear(); app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0];"
                           "app.canvas.setDirty(true, true);")
    time.sleep(0.5)
    a = ActionBuilder(browser)
    a.pointer_action.move_to_location(700, 400).double_click()
    a.perform()
    time.sleep(1.0)
    ActionChains(browser).send_keys("Max VRAM (VRAMCut)").perform()
    _wait(browser, "the search result", lambda: browser.execute_script(
        "return document.body.innerText.includes('Max VRAM (VRAMCut)')"))
    time.sleep(0.5)
    ActionChains(browser).send_keys("\ue007").perform()  # Enter
    st = _wait(browser, "the node added", lambda: browser.execute_script(ADDED_NODE_JS, NODE_TYPE))
    time.sleep(0.3)
    a = ActionBuilder(browser)  # the new node follows the pointer until a click places it
    a.pointer_action.move_to_location(600, 300).click()
    a.perform()
    time.sleep(1.0)  # several frames: the host's own sizing has run
    st = browser.execute_script(ADDED_NODE_JS, NODE_TYPE)
    png = _node_crop(browser, st["id"], 1.0)
    _save("fresh_node.png", png)
    assert st["area"] + 1 >= st["content"] and st["content"] >= 50, st  # header + the two-line hint


# The collapsed node's header box on the page.
COLLAPSED_BOX_JS = """
const node = app.graph.getNodeById(arguments[0]);
const ds = app.canvas.ds, th = LiteGraph.NODE_TITLE_HEIGHT;
const r = app.canvas.canvas.getBoundingClientRect();
return {left: r.left + (node.pos[0] + ds.offset[0]) * ds.scale, top: r.top + (node.pos[1] - th + ds.offset[1]) * ds.scale,
        width: (node._collapsed_width || 0) * ds.scale, height: th * ds.scale, title: node.getTitle()};
"""


def _collapsed_header_png(browser, node_id):
    from PIL import Image

    b = browser.execute_script(COLLAPSED_BOX_JS, node_id)
    page = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    out = io.BytesIO()
    page.crop((int(b["left"]) - 4, int(b["top"]) - 4, int(b["left"] + b["width"]) + 5,
               int(b["top"] + b["height"]) + 5)).save(out, "PNG")
    return b, out.getvalue()


def test_collapsed_node_shows_the_answer(comfy_server, browser):
    """Collapsed, the header carries the answer on screen (the host draws only 20 characters of
    a collapsed title: "Max VRAM (VRAMCut) ·" is all it would show)."""
    s = comfy_server
    node_id, _ = _run_example(browser, s)
    browser.execute_script(ZOOM_JS, node_id, 1.0, True)
    browser.execute_script("const n = app.graph.getNodeById(arguments[0]);"  # clear of the toolbars
                           "app.canvas.ds.offset = [300 - n.pos[0], 300 - n.pos[1]]; app.canvas.setDirty(true, true);", node_id)
    time.sleep(0.5)
    box, png = _collapsed_header_png(browser, node_id)
    _save("collapsed_node.png", png)
    browser.execute_script(ZOOM_JS, node_id, 1.0, False)
    assert " · fits " in box["title"], box
    assert _count_on_screen(png, FITS_COLOR) > 30, ("the answer is not drawn on the collapsed header", box)


VUE_NODES_JS = """
const [on, done] = arguments;
(async () => {
  await app.extensionManager.setting.set("Comfy.VueNodes.Enabled", on);
  done(!!LiteGraph.vueNodesMode);
})().catch((e) => done({error: String(e && e.stack || e)}));
"""

VUE_HEADER_JS = """
const node = app.graph.nodes.find((n) => n.type === arguments[0]);
const h = node && document.querySelector(`[data-testid="node-header-${node.id}"]`);
const s = h && h.querySelector(".vramcut-collapsed-answer");
if (!s) return null;
const r = s.getBoundingClientRect(), hr = h.getBoundingClientRect();
return {text: s.textContent, box: [r.left, r.top, r.width, r.height], header: [hr.left, hr.top, hr.width, hr.height]};
"""


def test_collapsed_node_shows_the_answer_in_nodes_2(comfy_server, browser):
    """The same in Nodes 2.0 (the header is a Vue component): the answer beside the title,
    inside the header's box, on screen."""
    from PIL import Image

    s = comfy_server
    _run_example(browser, s)
    try:
        assert browser.execute_async_script(VUE_NODES_JS, True) is True
        time.sleep(1.0)
        browser.execute_script("const n = app.graph.nodes.find((n) => n.type === arguments[0]); n.collapse();"
                               "app.canvas.setDirty(true, true);", NODE_TYPE)
        h = _wait(browser, "the answer in the collapsed header", lambda: browser.execute_script(VUE_HEADER_JS, NODE_TYPE))
        time.sleep(0.5)
        h = browser.execute_script(VUE_HEADER_JS, NODE_TYPE)
        assert h["text"].startswith("fits "), h
        x, y, w, ht = h["box"]
        hx, hy, hw, hh = h["header"]
        assert w > 20 and x >= hx - 1 and x + w <= hx + hw + 1 and y >= hy - 1 and y + ht <= hy + hh + 1, h  # not clipped
        page = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
        out = io.BytesIO()
        page.crop((int(hx) - 4, int(hy) - 4, int(hx + hw) + 5, int(hy + hh) + 5)).save(out, "PNG")
        _save("collapsed_node_nodes2.png", out.getvalue())
        assert _count_on_screen(out.getvalue(), FITS_COLOR) > 30, h
    finally:
        browser.execute_async_script(VUE_NODES_JS, False)


ALL_RESIDENT_GB = 0.3       # the random SD VAE's decoder fits whole: nothing streams


def test_cost_after_a_run_is_the_plans_not_the_measuring_pass(comfy_server, browser):
    """An all-resident VAE decoding once: that call was the measuring pass (every block through
    one slot); the plan streams nothing, so the node says +0 s per call, and its tooltip quotes
    no copies the plan does not make."""
    s = comfy_server
    _open(browser, s)
    ids = browser.execute_async_script(BUILD_VAE_GRAPH_JS, s.sd_vae, ALL_RESIDENT_GB, 1201)
    assert "error" not in ids, ids["error"]
    cut = ids["cut"]
    assert browser.execute_async_script(QUEUE_JS, [ids["decode"], ids["preview"]], 0) is True
    st = _wait_run(browser, s, cut, "measured")
    (line,) = _check_answer_lines(st["data"], s)
    assert re.search(r"all \d+ blocks resident · \+0 s / call$", line), line
    plan = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.payload.models[0].plan", cut)
    assert plan["streamed_bytes_per_forward"] == 0 and plan["stats"]["forwards"] >= 1, plan["stats"]
    assert plan["cost"]["measured_forwards"] == plan["steady_stats"]["forwards"], plan["cost"]
    tip = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.regions"
                                 ".map((r) => r.tip).find((t) => /Bandwidth/.test(t || ''))", cut)
    assert "Nothing streams" in tip and "only measured the shapes" in tip and not re.search(r"\d+ cop(y|ies)", tip), tip
    time.sleep(0.3)
    _save("all_resident_node.png", _node_crop(browser, cut, 1.0))


def test_refusal_names_the_model_and_reads_as_a_name(comfy_server, browser):
    """The refused model is marked in the payload; ComfyUI's error panel gets the exception by
    name (not the pack's folder path) and a message that leads with the fix."""
    s = comfy_server
    _open(browser, s)
    ids = browser.execute_async_script(BUILD_VAE_GRAPH_JS, s.sd_vae, REFUSED_BUDGET_GB, 1301)
    assert "error" not in ids, ids["error"]
    browser.execute_script("const n = app.graph.nodes.find((n) => n.type === 'EmptyLatentImage');"
                           "n.widgets[0].value = 512; n.widgets[1].value = 512;")
    browser.execute_script("window.__vramcutErrors = []; (async () => { const { api } = await import('/scripts/api.js');"
                           "api.addEventListener('execution_error', (e) => window.__vramcutErrors.push(e.detail)); })();")
    time.sleep(0.3)
    assert browser.execute_async_script(QUEUE_JS, [ids["decode"], ids["preview"]], 0) is True
    _wait_events(browser, ids["cut"], "execution_error", "execution_success")
    err = _wait(browser, "the error event", lambda: (e := browser.execute_script("return window.__vramcutErrors")) and e[0])
    assert err["exception_type"] == "vramcut.VRAMCutError", err["exception_type"]
    assert re.match(r"Max VRAM: set max_vram_gb to \d+\.\d+\. ", err["exception_message"]), err["exception_message"]
    raw = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.raw", ids["cut"])
    assert [m.get("refused") for m in raw["models"]] == [True], raw


SECOND_DECODE_JS = """
const [cutId, decodeId, previewId] = arguments;
const cut = app.graph.getNodeById(cutId), first = app.graph.getNodeById(decodeId);
const latent = app.graph.nodes.find((n) => n.type === "EmptyLatentImage");
// the same shape through another node, so that ComfyUI runs this decode too (not from its cache)
const f = LiteGraph.createNode("LatentFlip"), d = LiteGraph.createNode("VAEDecode"), p = LiteGraph.createNode("PreviewImage");
f.pos = [600, 400]; d.pos = [880, 400]; p.pos = [880, 520];
app.graph.add(f); app.graph.add(d); app.graph.add(p);
cut.connect(cut.findOutputSlot("vae"), d, d.findInputSlot("vae"));
latent.connect(0, f, 0);
f.connect(0, d, d.findInputSlot("samples"));
d.connect(0, p, 0);
return [f.id, d.id, p.id];
"""


def test_decodes_after_the_measuring_one_show_their_measured_cost(comfy_server, browser):
    """Two decodes in one prompt: the first measures, the second runs the plan; the node shows
    the second one's measured cost, and the figures are the plan's (bytes per call)."""
    s = comfy_server
    _open(browser, s)
    ids = browser.execute_async_script(BUILD_VAE_GRAPH_JS, s.sd_vae, VAE_BUDGET_GB, 1401)
    assert "error" not in ids, ids["error"]
    cut = ids["cut"]
    more = browser.execute_script(SECOND_DECODE_JS, cut, ids["decode"], ids["preview"])
    assert browser.execute_async_script(QUEUE_JS, [ids["decode"], ids["preview"], *more], 0) is True
    _wait_run(browser, s, cut, "measured")
    plan = _wait(browser, "the measured cost", lambda: (
        (p := browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.payload.models[0].plan", cut))
        ["cost"]["measured_forwards"] >= 1 and p))
    (line,) = _check_answer_lines(_node_state(browser, cut)["data"], s, estimate=False)
    assert plan["cost"]["measured_bytes_per_forward"] == plan["streamed_bytes_per_forward"], plan["cost"]
    # copies: the call after the measuring one makes the plan's copies, no more (it once counted
    # the copies issued ahead for a next call: 4 against 3)
    assert plan["cost"]["measured_copies_per_forward"] == plan["transfers_per_forward"], plan["cost"]


OPEN_EXAMPLE_JS = """
const [url, done] = arguments;
(async () => {
  const wf = await (await fetch(url)).json();
  await app.loadGraphData(wf, true, true, decodeURIComponent(url.split("/").pop().replace(/\\.json$/, "")));
  app.canvas.ds.scale = 1;
  app.canvas.ds.offset = [20, 50];
  app.canvas.setDirty(true, true);
  const cut = app.graph.nodes.find((n) => n.type === "%(node)s");
  done({id: cut.id, saved: wf.nodes.find((n) => n.type === "%(node)s").size});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": NODE_TYPE}


def _open_runnable_example(browser, s, name=RUNNABLE_EXAMPLE) -> dict:
    """Open an example (the plan preview) from the template endpoint; its node's id and saved size."""
    _open(browser, s)
    url = _template_url(s, name)
    r = browser.execute_async_script(OPEN_EXAMPLE_JS, url)
    assert "error" not in r, r["error"]
    time.sleep(1.0)
    return r


def test_plan_preview_example_opens_without_a_warning(comfy_server, browser):
    """The plan-preview example: the node is the model's only user (a preview), so no
    "not connected" warning; the warning stays for a model used elsewhere unpatched (see
    test_unused_output_is_warned_on_the_node)."""
    s = comfy_server
    r = _open_runnable_example(browser, s)
    d = _node_state(browser, r["id"])["data"]
    assert d.get("unused", "") == "", d
    warn = {"warning": ("#facc15", COLOR_TOLERANCE)}
    assert browser.execute_script(NODE_PIXELS_JS, r["id"], warn)["warning"] == 0


def test_opening_and_running_an_example_leaves_it_unchanged(comfy_server, browser):
    """The plan-preview example opened (no resize on load: no change, no undo step), pointed at
    the tiny model and saved, then run: the plan fits the saved height, still unchanged."""
    s = comfy_server
    r = _open_runnable_example(browser, s)
    opened = browser.execute_script(TRACKER_JS, r["id"], False)
    assert not opened["modified"] and opened["undo"] == 0, opened
    assert opened["size"] == r["saved"], (opened, r)
    browser.execute_script("""const n = app.graph.nodes.find((n) => n.type === "UNETLoader");
      n.widgets.find((w) => w.name === "unet_name").value = arguments[0];""" + SHAPE_JS, s.tiny_model)
    saved = browser.execute_script(TRACKER_JS, r["id"], True)
    browser.execute_async_script("const done = arguments[0]; app.queuePrompt(0).then(() => done(true));")
    _wait(browser, "the traced plan to be drawn", lambda: _traced_plan_drawn(browser))
    time.sleep(1.0)
    _save("example_preview_run.png", _node_crop(browser, r["id"], 1.0))
    after = browser.execute_script(TRACKER_JS, r["id"], False)
    assert not after["modified"] and after["undo"] == saved["undo"] and after["size"] == saved["size"], (saved, after)

    # the Flux example (not runnable here) opens unchanged too
    r = _open_runnable_example(browser, s, FLUX_EXAMPLE)
    opened = browser.execute_script(TRACKER_JS, r["id"], False)
    assert not opened["modified"] and opened["undo"] == 0 and opened["size"] == r["saved"], (opened, r)
