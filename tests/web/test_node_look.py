"""What the node looks like on screen, read back from the page: the template browser, the details
and the table at the default width and narrower, the colours, the budget's digits, a cleared
workflow, and (opt-in) the pictures in docs/.

Each check reads what is drawn (the canvas's pixels, the boxes of the texts the plan drew, the
DOM's boxes), not only the DOM's text. The page helpers are test_browser.py's; this module starts
its own browser (a module-scoped fixture in conftest.py; the server is the session's, its prompt cache dropped for each module).

The pictures in docs/ and the template thumbnails are written by test_docs_pictures.py.
"""
from __future__ import annotations

import io
import os
import sys
import time

import pytest

# the page helpers are test_browser.py's (pytest imports test modules by path, not from sys.path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_browser as tb
from graphs import clear_and_build

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

DEFAULT_WIDTH = 360          # web/vramcut.js MIN_NODE_WIDTH: a new node's width
NARROW_WIDTHS = (240, 200, 160)
MIN_CONTRAST = 4.5           # WCAG AA for small text
MIN_CVD_DELTA_E = 20         # CIE76 distance the plan's fills keep under each simulated deficiency
MIN_ACTIVATION_PX = 18       # the tallest activation bar, css px
JPEG_TOLERANCE = 40          # thumbnails are JPEGs: colours come back near, not exact

# What the plan drew: every text with its box and the fill under it, the segment bars, the
# buttons' box, all in the plan element's css pixels.
VIEW_JS = """
const node = app.graph.getNodeById(arguments[0]);
const v = node.vramcutView;
const c = v.canvas.getBoundingClientRect(), b = v.bar.getBoundingClientRect();
const k = c.width ? v.el.clientWidth / c.width : 1;
return {texts: v.texts || [], bars: v.bars || [], W: v.el.clientWidth, H: v.el.clientHeight,
        buttons: v.bar.style.display === "none" ? null : [(b.left - c.left) * k, (b.top - c.top) * k, b.width * k, b.height * k],
        data: {...v.el.dataset}, size: [node.size[0], node.size[1]],
        fits: v.el.clientHeight > 0 && Math.abs(v.el.clientHeight - v.contentHeight(v.el.clientWidth)) <= 1};
"""

# The canvas's pixels in css boxes [x, y, w, h]: for each, how many are painted, and the pixels
# themselves (RGBA rows) when asked.
PIXELS_JS = """
const [nodeId, boxes, withPixels] = arguments;
const v = app.graph.getNodeById(nodeId).vramcutView;
const s = v.drawnScale || 1;
const ctx = v.canvas.getContext("2d");
return boxes.map(([x, y, w, h]) => {
  const X = Math.max(0, Math.floor(x * s)), Y = Math.max(0, Math.floor(y * s));
  const W = Math.max(1, Math.min(v.canvas.width - X, Math.ceil(w * s))), H = Math.max(1, Math.min(v.canvas.height - Y, Math.ceil(h * s)));
  const d = ctx.getImageData(X, Y, W, H).data;
  let painted = 0;
  for (let i = 3; i < d.length; i += 4) if (d[i] > 0) painted++;
  return {painted, w: W, h: H, px: withPixels ? Array.from(d) : null};
});
"""

# The tallest vertical run of one colour in the canvas, in css px.
RUN_JS = """
const [nodeId, hex, tol] = arguments;
const v = app.graph.getNodeById(nodeId).vramcutView;
const c = v.canvas, d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
const want = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
let best = 0;
for (let x = 0; x < c.width; x++) {
  let run = 0;
  for (let y = 0; y < c.height; y++) {
    const i = (y * c.width + x) * 4;
    const ok = d[i + 3] > 200 && Math.abs(d[i] - want[0]) <= tol && Math.abs(d[i + 1] - want[1]) <= tol && Math.abs(d[i + 2] - want[2]) <= tol;
    run = ok ? run + 1 : 0;
    if (run > best) best = run;
  }
}
return best / (v.drawnScale || 1);
"""

SET_WIDTH_JS = """
const [nodeId, width] = arguments;
const n = app.graph.getNodeById(nodeId);
n.setSize([width, n.size[1]]);
app.canvas.setDirty(true, true);
"""

FIT_JS = "const n = app.graph.getNodeById(arguments[0]); n.vramcutFit({shrink: true}); app.canvas.setDirty(true, true);"


def _hex(c: str) -> tuple[int, int, int]:
    return tuple(int(c[i:i + 2], 16) for i in (1, 3, 5))


def _rel_lum(rgb) -> float:
    lin = [(v / 255) / 12.92 if v / 255 <= 0.04045 else ((v / 255 + 0.055) / 1.055) ** 2.4 for v in rgb[:3]]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a, b) -> float:
    x, y = sorted((_rel_lum(a), _rel_lum(b)), reverse=True)
    return (x + 0.05) / (y + 0.05)


# Machado et al. (2009) simulation matrices at full severity, applied to linear RGB.
CVD = {
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216), (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413), (-0.011820, 0.042940, 0.968881)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602), (0.004733, 0.691367, 0.303900)),
}


def _lab(rgb, deficiency=None):
    import numpy as np

    c = np.array(rgb[:3], dtype=float) / 255
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    if deficiency:
        lin = np.clip(np.array(CVD[deficiency]) @ lin, 0, 1)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ lin
    xyz = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _delta_e(a, b, deficiency=None) -> float:
    import numpy as np

    return float(np.linalg.norm(_lab(a, deficiency) - _lab(b, deficiency)))


def _view(browser, node_id) -> dict:
    return browser.execute_script(VIEW_JS, node_id)


def _set_width(browser, node_id, width) -> dict:
    """The node at ``width`` (as a user drags it), then fitted to its plan's height; once drawn."""
    browser.execute_script(SET_WIDTH_JS, node_id, width)
    time.sleep(0.3)  # the host lays out the new width
    browser.execute_script(FIT_JS, node_id)
    return tb._wait(browser, f"the plan fitted at width {width}", lambda: (
        (v := _view(browser, node_id))["fits"] and abs(v["size"][0] - width) < 1 and v))


def _on_screen_contrast(browser, node_id, text) -> float:
    """The contrast, on the canvas, between a text's fill and the glyph pixel farthest from it."""
    (box,) = browser.execute_script(PIXELS_JS, node_id, [[text["x"], text["y"], text["w"], text["h"]]], True)
    bg = _hex(text["bg"])
    px = box["px"]
    pixels = [tuple(px[i:i + 3]) for i in range(0, len(px), 4) if px[i + 3] > 200]
    assert pixels, text
    # the fill is there (the text sits on it), and the glyphs' core stands out from it
    assert sum(1 for p in pixels if max(abs(p[k] - bg[k]) for k in range(3)) <= 3) > len(pixels) // 3, (text, bg)
    core = max(pixels, key=lambda p: sum((p[k] - bg[k]) ** 2 for k in range(3)))
    return _contrast(core, bg)


def _overlaps(a, b) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def _vae_run(browser, s, budget_gb, first_id, details=True, latent=None):
    """The VAE decode graph built in the page (test_browser.py) and queued; ``latent``: its side."""
    tb._open(browser, s)
    ids = browser.execute_async_script(tb.BUILD_VAE_GRAPH_JS, s.sd_vae, budget_gb, first_id)
    assert "error" not in ids, ids["error"]
    if latent:
        browser.execute_script("const n = app.graph.nodes.find((n) => n.type === 'EmptyLatentImage');"
                               "n.widgets[0].value = arguments[0]; n.widgets[1].value = arguments[0];", latent)
    if details:
        browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutSetDetails(true)", ids["cut"])
    assert browser.execute_async_script(tb.QUEUE_JS, [ids["decode"], ids["preview"]], 0) is True
    return ids


# ------------------------------------------------------------------ 8: details, table, narrow

def test_details_and_table_read_whole_at_the_default_width(comfy_server, browser):
    """The VAE's measured plan with its details at the default width: every text whole and inside
    the node, the segment labels distinct and inside their bars, text on a fill at 4.5:1 or more
    on screen, activation bars tall enough to compare, the counts whole; the table as wide as the
    node, its counts the chart's; and at 160-240 px nothing drawn under the buttons."""
    from selenium.webdriver.common.by import By

    s = comfy_server
    ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 1501)
    cut = ids["cut"]
    tb._wait_run(browser, s, cut, "measured")
    v = _set_width(browser, cut, DEFAULT_WIDTH)
    d, W = v["data"], v["W"]
    tb._save("details_360.png", tb._node_crop(browser, cut, 1.0))

    texts = v["texts"]
    assert texts, "the plan reported no drawn texts"
    for t in texts:
        assert t["x"] >= -0.5 and t["x"] + t["w"] <= W + 0.5, ("text outside the node", t, W)
        assert not t["text"].endswith("…"), ("text cut", t)
    labels = [t for t in texts if t["kind"] == "segment"]
    assert len(labels) >= 2 and len({t["text"] for t in labels}) == len(labels), labels
    for t in labels:
        bar = next(b for b in v["bars"] if b["label"] == t["text"])
        assert bar["x"] <= t["x"] and t["x"] + t["w"] <= bar["x"] + bar["w"] + 0.5, (t, bar)
    on_fills = [t for t in texts if t["bg"]]
    assert len(on_fills) >= 3, on_fills  # the labels and the badge
    for t in on_fills:
        assert _on_screen_contrast(browser, cut, t) >= MIN_CONTRAST, t

    tallest = browser.execute_script(RUN_JS, cut, d["activationColor"], 2)
    assert tallest >= MIN_ACTIVATION_PX, tallest
    counts = " ".join(t["text"] for t in texts if t["kind"] == "counts")
    chart = f"{d['resident']} resident · {d['streamed']} streamed · {d['idle']} idle segments"
    assert chart in counts, (chart, counts)

    # the table: inside the node's box, no sideways scrolling, its counts the chart's
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()
    table = tb._wait(browser, "the table", lambda: browser.execute_script("""
      const v = app.graph.getNodeById(arguments[0]).vramcutView, t = v.pre;
      if (t.style.display === "none" || !t.clientWidth) return null;
      const r = t.getBoundingClientRect(), e = v.el.getBoundingClientRect();
      const right = Math.max(...[...t.querySelectorAll("td, th, div")].map((c) => c.getBoundingClientRect().right));
      return {scroll: t.scrollWidth, client: t.clientWidth, box: [r.left, r.right], el: [e.left, e.right], right, text: t.textContent};
    """, cut))
    # every row of the table shown: on 0.3.64's frontend the node is taller than the page at scale 1
    tb._save("table_360.png", tb._node_crop(browser, cut, 0.85, at=(100, 60)))
    assert table["scroll"] <= table["client"] + 1, table
    assert table["box"][0] >= table["el"][0] - 0.5 and table["box"][1] <= table["el"][1] + 0.5, table
    assert table["right"] <= table["box"][1] + 0.5, table
    assert chart in table["text"], (chart, table["text"])
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-toggle").click()

    for width in NARROW_WIDTHS:
        v = _set_width(browser, cut, width)
        tb._save(f"details_{width}.png", tb._node_crop(browser, cut, 1.0))
        assert v["buttons"], v
        for t in v["texts"]:
            assert t["x"] >= -0.5 and t["x"] + t["w"] <= v["W"] + 0.5, (width, t)
            assert not _overlaps([t["x"], t["y"], t["w"], t["h"]], v["buttons"]), ("under the buttons", width, t, v["buttons"])
            if t["kind"] in ("title", "budget", "answer", "label", "counts"):
                assert not t["text"].endswith("…"), (width, t)
        (under,) = browser.execute_script(PIXELS_JS, cut, [v["buttons"]], False)
        assert under["painted"] == 0, ("the canvas draws under the buttons", width, under)
    browser.execute_script(SET_WIDTH_JS, cut, DEFAULT_WIDTH)


# ------------------------------------------------------------------------ 9: colours, legend

def test_plan_colours_stay_apart_for_colour_blind_eyes_with_a_legend(comfy_server, browser):
    """The plan's four fills stay apart under protanopia, deuteranopia and tritanopia (simulated),
    and the compact view carries a legend, drawn in both palettes."""
    s = comfy_server
    node_id, _ = tb._run_example(browser, s)
    d = _view(browser, node_id)["data"]
    fills = {k: _hex(d[f"{k}Color"]) for k in ("resident", "streamed", "activation", "idle")}
    names = sorted(fills)
    for deficiency in (None, *CVD):
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                de = _delta_e(fills[a], fills[b], deficiency)
                assert de >= MIN_CVD_DELTA_E, (a, b, deficiency or "normal vision", round(de, 1))

    try:
        for palette in ("dark", "light"):
            assert browser.execute_async_script(tb.THEME_JS, palette) is True
            v = tb._wait(browser, f"the plan drawn in the {palette} palette", lambda: (
                (x := _view(browser, node_id))["data"].get("fg") == browser.execute_script(
                    "return getComputedStyle(document.documentElement).getPropertyValue('--input-text').trim()")
                and x["texts"] and x))
            legend = [t for t in v["texts"] if t["kind"] == "legend"]
            assert {"resident", "streamed", "budget"} <= {t["text"] for t in legend}, (palette, v["texts"])
            # the swatches are on the canvas, left of their words
            row = [0, min(t["y"] for t in legend) - 2, v["W"], max(t["h"] for t in legend) + 4]
            colors = {k: (d[f"{k}Color"], tb.COLOR_TOLERANCE) for k in ("resident", "streamed")}
            (box,) = browser.execute_script(PIXELS_JS, node_id, [row], True)
            px = box["px"]
            for k, (hexc, tol) in colors.items():
                want = _hex(hexc)
                n = sum(1 for i in range(0, len(px), 4)
                        if px[i + 3] > 200 and all(abs(px[i + j] - want[j]) <= tol for j in range(3)))
                assert n >= 50, (palette, k, n)
            tb._save(f"legend_{palette}.png", tb._node_crop(browser, node_id, 1.0))
    finally:
        browser.execute_async_script(tb.THEME_JS, "dark")


# ------------------------------------------------------------------------------ 10: small things

# Every string the graph's canvas draws in one frame.
CANVAS_STRINGS_JS = """
const seen = [];
const orig = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (t, ...rest) { seen.push(String(t)); return orig.call(this, t, ...rest); };
try { app.canvas.draw(true, true); } finally { CanvasRenderingContext2D.prototype.fillText = orig; }
return seen;
"""


def test_budget_reads_to_the_thousandth_and_off_at_zero(comfy_server, browser):
    """max_vram_gb at 0.001 is drawn as 0.001 (the host's two decimals read "0.00"); a budget of
    0 runs with VRAMCut off and the header says so, with no "not connected" warning."""
    s = comfy_server
    r = tb._open_runnable_example(browser, s)
    # an earlier test of this module ran the example with another model and budget: not this plan
    assert _view(browser, r["id"])["data"].get("hasPlan") == "false", "a plan made for other inputs is shown"
    browser.execute_script("const n = app.graph.getNodeById(arguments[0]);"
                           "n.widgets.find((w) => w.name === 'max_vram_gb').value = 0.001;", r["id"])
    drawn = browser.execute_script(CANVAS_STRINGS_JS)
    assert any("0.001" in t for t in drawn) and not any(t.strip() == "0.00" for t in drawn), drawn

    tb._open(browser, s)
    r = browser.execute_async_script(tb.RUN_EXAMPLE_JS, tb._template_url(s, tb.RUNNABLE_EXAMPLE), s.tiny_model, 0)
    assert "error" not in r, r
    v = tb._wait(browser, "the plan with VRAMCut off", lambda: (
        (x := _view(browser, r["id"]))["data"].get("hasPlan") == "true" and any(t["kind"] == "budget" for t in x["texts"]) and x))
    (budget,) = [t["text"] for t in v["texts"] if t["kind"] == "budget"]
    assert budget == "budget off", budget
    assert not any("0.000 GiB" in t["text"] for t in v["texts"]), v["texts"]
    assert v["data"].get("unused", "") == "", v["data"]


def test_unused_warning_only_with_vramcut_on_and_below_the_error(comfy_server, browser):
    """The decode fed from the loader: no warning while the budget is 0 (VRAMCut off); with a
    budget the warning shows, and below a red error when the plan carries one."""
    s = comfy_server
    tb._open(browser, s)
    ids = browser.execute_async_script(tb.BUILD_VAE_GRAPH_JS, s.sd_vae, 0, 1601)
    assert "error" not in ids, ids["error"]
    cut = ids["cut"]
    loader = str(int(cut) - 1)
    assert browser.execute_script(tb.UNUSED_JS, loader, cut, ids["decode"], True) is True
    for _ in range(5):  # frames: the node checks its links while it is drawn
        browser.execute_script("app.canvas.setDirty(true, true);")
        time.sleep(0.3)
    assert _view(browser, cut)["data"].get("unused", "") == ""
    warn = {"warning": ("#facc15", tb.COLOR_TOLERANCE)}
    assert browser.execute_script(tb.NODE_PIXELS_JS, cut, warn)["warning"] == 0

    browser.execute_script("app.graph.getNodeById(arguments[0]).widgets.find((w) => w.name === 'max_vram_gb').value = 0.16;", cut)
    tb._wait(browser, "the warning", lambda: (
        browser.execute_script("app.canvas.setDirty(true, true);") or _view(browser, cut)["data"].get("unused") == "VAE"))
    # a plan that carries an error (as a refused run sends it), shown on this node
    browser.execute_script("""
      const n = app.graph.getNodeById(arguments[0]);
      n.vramcutShow({budget_bytes: 0.16 * 1024 ** 3, enabled: true, message: "Max VRAM: set max_vram_gb to 0.200. The budget is too small.",
                     min_budget_bytes: 0.2 * 1024 ** 3, min_budget_exact: true, models: []});""", cut)
    v = tb._wait(browser, "the error and the warning drawn", lambda: (
        (x := _view(browser, cut)) and any("not connected" in t["text"] for t in x["texts"])
        and any("Set max_vram_gb" in t["text"] for t in x["texts"]) and x))
    error_y = min(t["y"] for t in v["texts"] if "Set max_vram_gb" in t["text"])
    warning_y = min(t["y"] for t in v["texts"] if "not connected" in t["text"])
    assert error_y < warning_y, v["texts"]
    tb._save("error_above_warning.png", tb._node_crop(browser, cut, 1.0))


def test_plan_of_a_cleared_workflow_survives_a_reload(comfy_server, browser):
    """Clear Workflow leaves the graph without an id; the frontend gives it a new one when the
    page is loaded again. The node's plan still comes back from the history."""
    s = comfy_server
    tb._run_example(browser, s)
    r = clear_and_build(browser, s.tiny_model)
    tb._wait(browser, "the plan", lambda: _view(browser, r["id"])["data"].get("hasPlan") == "true")
    time.sleep(1.5)  # the workflow is kept in the browser's storage
    tb._open(browser, s, fresh=False)  # (frontends before 1.49 keep the empty id on reload)
    tb._wait(browser, "the plan after the reload", lambda: (
        (x := browser.execute_script("const n = app.graph.getNodeById(arguments[0]); return n && n.vramcutView && n.vramcutView.el.dataset", r["id"]))
        and x.get("hasPlan") == "true" and int(x.get("segments", 0)) > 0))


# ------------------------------------------------------------------------- 7: template browser

TEMPLATE_CARDS_JS = """
const [names, done] = arguments;
(async () => {
  await app.extensionManager.command.execute("Comfy.BrowseTemplates");
  const t0 = Date.now();
  // the pack's category in the dialog's navigation (its name from the pack's locale)
  const leaves = (root, text) => [...root.querySelectorAll("*")].filter((e) => e.childElementCount === 0 && e.textContent.trim() === text);
  const find = () => {
    const d = document.querySelector("[role=dialog]");
    const hit = d && leaves(d, "VRAMCut").pop();
    return hit && (hit.closest("[role=button], button, a, li, [role=option], [role=menuitem], [role=treeitem]") || hit);
  };
  while (!find() && Date.now() - t0 < 20000) await new Promise((r) => setTimeout(r, 200));
  find().click();
  const cards = () => names.map((n) => document.querySelector(`[data-testid="template-workflow-${n}"]`));
  while (cards().some((c) => !c || !c.querySelector("img") || !c.querySelector("img").complete) && Date.now() - t0 < 30000)
    await new Promise((r) => setTimeout(r, 200));
  await new Promise((r) => setTimeout(r, 500));
  done(cards().map((c, i) => {
    if (!c) return null;
    const h = leaves(c, names[i])[0] || c, img = c.querySelector("img"), ir = img.getBoundingClientRect();
    return {title: h.textContent.trim(), clipped: h.scrollWidth > h.clientWidth + 1 || h.scrollHeight > h.clientHeight + 1,
            natural: img.naturalWidth, img: [ir.left, ir.top, ir.width, ir.height]};
  }));
})().catch((e) => done({error: String(e && e.stack || e)}));
"""


def test_template_browser_titles_the_examples_and_shows_a_real_run(comfy_server, browser):
    """ComfyUI's template browser lists the examples by title, whole on their cards, and the
    plan preview's thumbnail shows the plan in today's colours (a run of today's node)."""
    from PIL import Image

    s = comfy_server
    tb._open(browser, s)
    cards = browser.execute_async_script(TEMPLATE_CARDS_JS, [tb.RUNNABLE_EXAMPLE, tb.FLUX_EXAMPLE])
    assert isinstance(cards, list) and all(cards), cards
    page = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    tb._save("template_browser.png", _png(page))
    for name, c in zip((tb.RUNNABLE_EXAMPLE, tb.FLUX_EXAMPLE), cards):
        assert c["title"] == name and not c["clipped"] and c["natural"] >= 256, c
    x, y, w, h = cards[0]["img"]
    thumb = _png(page.crop((int(x), int(y), int(x + w), int(y + h))))
    for color in (tb.RESIDENT_COLOR, tb.STREAMED_COLOR):
        assert _count_near(thumb, color, JPEG_TOLERANCE) > 30, (color, "the thumbnail does not show today's plan")
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).send_keys("\ue00c").perform()  # Escape


def _png(img) -> bytes:
    out = io.BytesIO()
    img.save(out, "PNG", optimize=True)
    return out.getvalue()


def _count_near(png: bytes, hex_color: str, tol: int) -> int:
    import numpy as np
    from PIL import Image

    want = np.array(_hex(hex_color), dtype=np.int16)
    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    return int((np.abs(px - want) <= tol).all(axis=-1).sum())
