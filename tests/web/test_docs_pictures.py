"""The pictures in docs/ and the template thumbnails, each from a real run in the browser (opt-in:
``VRAMCUT_WRITE_DOCS=1``): screenshots at 1600x1000 and 1280x720 into docs/screenshots/ (a fresh
node, a refusal, collapsed, details and table at the node's default width, both examples just
opened), the README picture docs/node_plan.png at the default width, and the JPEG thumbnail
beside each example (the plan preview's from its run on the tiny model; the Flux example's as it
opens, as no Flux model is here to run).

The page helpers are test_browser.py's and test_node_look.py's.
"""
from __future__ import annotations

import io
import os
import sys
import time

import pytest

# the page helpers (pytest imports test modules by path, not from sys.path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_browser as tb
from test_node_look import _vae_run, _view

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

SCREENSHOTS = os.path.join(os.path.dirname(os.path.dirname(tb.HERE)), "docs", "screenshots")

VIEWPORTS = ((1600, 1000), (1280, 720))
THUMBNAIL_PX = 512

ADD_NODE_JS = """
app.graph.clear();
const n = LiteGraph.createNode(arguments[0]);
n.pos = [420, 200];
app.graph.add(n);
app.canvas.ds.scale = 1;
app.canvas.ds.offset = [0, 0];
app.canvas.setDirty(true, true);
return n.id;
"""


def _viewport(browser, w, h):
    """The page at exactly w x h css pixels (a window's size would include its frame)."""
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False})


def _small_png(png: bytes) -> bytes:
    """The screenshot in a 256-colour palette that covers the picture (no colour moves by more than
    a few levels, unlike a median cut, which turned the green verdict teal): a third of the bytes."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    img = img.quantize(256, method=Image.Quantize.MAXCOVERAGE, kmeans=3, dither=Image.Dither.NONE)
    out = io.BytesIO()
    img.save(out, "PNG", optimize=True)
    return out.getvalue()


def _shot(browser, name, w, h):
    # the graph clear of the sidebar and the toolbars
    browser.execute_script("app.canvas.ds.scale = 1; app.canvas.ds.offset = [90, 70]; app.canvas.setDirty(true, true);")
    time.sleep(0.5)  # the frame that positions the DOM widgets
    path = os.path.join(SCREENSHOTS, f"{name}_{w}x{h}.png")
    with open(path, "wb") as f:
        f.write(_small_png(browser.get_screenshot_as_png()))
    print(f"\nscreenshot: {path}")


def _thumbnail(browser, node_id, name, grow=1.25):
    """A square around the node, from the page as it is, saved as the example's JPEG thumbnail."""
    from PIL import Image

    box = browser.execute_async_script(tb.FRAME_NODE_JS, node_id, 1.0, 320, 200, None, None)
    page = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    side = int(max(box["width"], box["height"]) * grow)
    cx, cy = box["left"] + box["width"] / 2, box["top"] + box["height"] / 2
    left = int(max(0, min(page.width - side, cx - side / 2)))
    top = int(max(0, min(page.height - side, cy - side / 2)))
    img = page.crop((left, top, left + side, top + side)).resize((THUMBNAIL_PX, THUMBNAIL_PX), Image.Resampling.LANCZOS)
    path = os.path.join(tb.EXAMPLES, name + ".jpg")
    img.save(path, "JPEG", quality=85, optimize=True)
    print(f"\nthumbnail: {path}")


@pytest.mark.skipif(os.environ.get("VRAMCUT_WRITE_DOCS") != "1", reason="writes docs/ pictures: set VRAMCUT_WRITE_DOCS=1")
def test_docs_pictures(comfy_server, browser):
    """The pictures in docs/ and the template thumbnails, each from a real run in this browser:
    the README picture at the node's default width, screenshots at 1600x1000 and 1280x720 (a
    fresh node, a refusal, collapsed, details and table at width 360, both examples just
    opened)."""
    s = comfy_server
    os.makedirs(SCREENSHOTS, exist_ok=True)
    try:
        _viewport(browser, 1280, 720)
        # the plan preview's thumbnail: the example run on the tiny model, both kinds of segment
        tb._open(browser, s)
        r = browser.execute_async_script(tb.RUN_EXAMPLE_JS, tb._template_url(s, tb.RUNNABLE_EXAMPLE), s.tiny_model, s.tiny_budget_gb)
        assert "error" not in r, r
        tb._wait(browser, "the plan", lambda: tb._plan_drawn(browser))
        _thumbnail(browser, r["id"], tb.RUNNABLE_EXAMPLE, grow=1.08)
        # the Flux example as it opens (no Flux model here to run)
        r = tb._open_runnable_example(browser, s, tb.FLUX_EXAMPLE)
        _thumbnail(browser, r["id"], tb.FLUX_EXAMPLE, grow=1.08)

        for w, h in VIEWPORTS:
            _viewport(browser, w, h)
            tb._open(browser, s)
            node_id = browser.execute_script(ADD_NODE_JS, tb.NODE_TYPE)
            tb._wait(browser, "the fresh node fitted", lambda n=node_id: _view(browser, n)["fits"])
            _shot(browser, "fresh_node", w, h)

            ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 1700 + w // 10)
            tb._wait_run(browser, s, ids["cut"], "measured")
            tb._wait(browser, "the details fitted", lambda c=ids["cut"]: _view(browser, c)["fits"])
            if (w, h) == VIEWPORTS[0]:  # the taller page holds the node at 150 %
                png = tb._node_crop(browser, ids["cut"], tb.DOCS_ZOOM, hide_links=True, at=(400, 80))
                with open(tb.DOCS_IMAGE, "wb") as f:
                    f.write(_small_png(png))
                browser.execute_script("app.canvas.links_render_mode = LiteGraph.SPLINE_LINK;")
                browser.execute_script("app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0]; app.canvas.setDirty(true, true);")
            _shot(browser, "details_360", w, h)
            browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutView.toggleTable(true)", ids["cut"])
            _shot(browser, "table_360", w, h)

            ids = _vae_run(browser, s, tb.REFUSED_BUDGET_GB, 1800 + w // 10, details=False, latent=512)
            tb._wait(browser, "the refusal", lambda c=ids["cut"]: _view(browser, c)["data"].get("state") == "refused",
                     timeout=tb.PROMPT_TIMEOUT_S)
            _shot(browser, "refused", w, h)

            node_id, _ = tb._run_example(browser, s)
            browser.execute_script(tb.ZOOM_JS, node_id, 1.0, True)
            browser.execute_script("app.canvas.ds.offset = [20, 50]; app.canvas.setDirty(true, true);")
            _shot(browser, "collapsed", w, h)

            for name, tag in ((tb.RUNNABLE_EXAMPLE, "example_plan_preview"), (tb.FLUX_EXAMPLE, "example_flux")):
                tb._open_runnable_example(browser, s, name)
                _shot(browser, tag, w, h)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
