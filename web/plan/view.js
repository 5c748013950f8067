// The plan's DOM widget: the canvas, the "details" / "table" buttons and the table.
//
// PlanView owns its element, its canvas and their observers, and schedules every redraw through
// requestAnimationFrame (one frame, however many changes); `destroy` undoes all of it. It owns
// the node's fit (fit.js) and asks it to fit whenever what it shows changes. Pointer events on
// the plan are handed to LiteGraph (pointer.js), so the plan acts like the rest of the node; the
// tooltip and the palette watch are the page's (tip.js). `attachPlan` gives a new node its view,
// its widget and its live events.
// Rule: nothing happens at import (ComfyUI also loads this file on its own as an extension
// script), and ComfyUI's `app` comes in as an argument (its scripts/app.js is one folder further
// away from here).

import { normalizePayload, summarize } from "./payload.js";
import { answer, refusal, refusalFor } from "./format.js";
import { HEADER_H, LOW_ZOOM, render } from "./draw.js";
import { COLORS, FONT_FALLBACK, readTheme } from "./theme.js";
import { fillTable } from "./table.js";
import { MARGIN, MIN_NODE_WIDTH, NodeFit } from "./fit.js";
import { syncVueHeader, unusedOutputs } from "./node.js";
import { forgetView, views } from "./tip.js";
import { handPointerToGraph } from "./pointer.js";
import { devicesLinked, showThousandths } from "./devices.js";

const WIDGET_NAME = "vramcut_plan";
const VIEW_PROPERTY = "vramcut_view";   // "details" when the user expanded the node (a user edit)
const LEGACY_PROPERTY = "vramcut_plan"; // older versions saved the plan here: still shown, never written

/** The widget's elements: the plan's box, its canvas, the table (hidden) and the buttons' bar;
 * `onDetails`, `onTable`: what the two buttons do. */
function planElements(onDetails, onTable) {
  const el = document.createElement("div");
  el.className = "vramcut-plan";
  Object.assign(el.style, {
    position: "relative", width: "100%", height: "100%", boxSizing: "border-box",
    overflow: "hidden", fontFamily: FONT_FALLBACK,
  });
  el.dataset.residentColor = COLORS.resident;
  el.dataset.streamedColor = COLORS.streamed;
  el.dataset.activationColor = COLORS.activation;
  el.dataset.idleColor = COLORS.idle;

  const canvas = document.createElement("canvas");
  canvas.className = "vramcut-plan-canvas";
  Object.assign(canvas.style, { display: "block", width: "100%", height: "100%" });

  // the table: as wide as the node (names wrap, numbers stay whole), scrolled only downwards
  const pre = document.createElement("div");
  pre.className = "vramcut-plan-table";
  Object.assign(pre.style, {
    display: "none", position: "absolute", left: "0", right: "0", top: `${HEADER_H}px`, bottom: "0",
    margin: "0", padding: "4px 6px", overflowX: "hidden", overflowY: "auto", pointerEvents: "auto",
    font: `11px/1.35 ${FONT_FALLBACK}`, fontVariantNumeric: "tabular-nums",
    background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)",
    border: "1px solid var(--border-color, #4e4e4e)", borderRadius: "4px", boxSizing: "border-box",
    userSelect: "text",
  });
  // the table scrolls on its own; the graph zooms everywhere else
  pre.addEventListener("wheel", (e) => e.stopPropagation(), { passive: true });

  const bar = document.createElement("div");
  Object.assign(bar.style, { position: "absolute", right: "0", top: "0", display: "flex", gap: "4px" });
  const detailsButton = makeButton("details", "Show every segment, the legend and all warnings", onDetails);
  detailsButton.className = "vramcut-plan-details";
  const button = makeButton("table", "Show the plan as a text table", onTable);
  button.className = "vramcut-plan-toggle";
  bar.append(detailsButton, button);
  el.append(canvas, pre, bar);
  return { el, canvas, pre, bar, detailsButton, button };
}

function makeButton(text, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.title = title;
  Object.assign(b.style, {
    height: "18px", padding: "0 8px", pointerEvents: "auto",
    font: `600 11px ${FONT_FALLBACK}`, lineHeight: "16px", cursor: "pointer",
    color: "var(--input-text, #ddd)", background: "var(--comfy-input-bg, #222)",
    border: "1px solid var(--border-color, #4e4e4e)", borderRadius: "9px",
  });
  b.addEventListener("pointerdown", (e) => e.stopPropagation());
  b.addEventListener("click", (e) => {
    e.stopPropagation();
    onClick();
  });
  return b;
}

export class PlanView {
  /** `app`: ComfyUI's app (its LiteGraph canvas gives the zoom and takes the plan's pointer events). */
  constructor(node, app) {
    this.node = node;
    this.app = app;
    this.payload = null;
    this.raw = null;
    this.regions = [];
    this.frame = 0;
    this.showTable = false;
    this.details = false;
    this.unused = [];
    this.drawnScale = 0;
    this.drawnLow = null;
    this.themeKey = "";
    this.themeCheckedAt = 0;

    const { el, canvas, pre, bar, detailsButton, button } = planElements(
      () => this.chooseDetails(!this.details), () => this.toggleTable());
    Object.assign(this, { el, canvas, pre, bar, detailsButton, button, ctx: canvas.getContext("2d") });
    handPointerToGraph(this);

    this.resizeObserver = typeof ResizeObserver === "function" ? new ResizeObserver(() => this.scheduleDraw()) : null;
    this.resizeObserver?.observe(this.el);
    views.add(this);
    this.fit = new NodeFit(node, this);
    this.updateDataset();
  }

  setPayload(payload) {
    this.raw = payload ?? null;
    this.payload = normalizePayload(payload);
    fillTable(this.pre, this.payload);
    this.updateDataset();
    this.scheduleDraw();
  }

  /** Show `payload` on the node: the node's height follows the content (`restore`: a plan shown
   * again in a loaded workflow, which keeps its saved size unless the plan would be cut). */
  show(payload, { restore = false } = {}) {
    this.setPayload(payload);
    syncVueHeader(this.node);
    this.fit.contentChanged({ restore });
    this.node.setDirtyCanvas?.(true, false);
  }

  /** A loaded workflow: its view (details or not) as saved, and its plan as this page or the
   * server's history knows it (`history`: a PlanHistory), once the load says which workflow
   * the node is in. */
  restore(history) {
    this.fit.settle(); // a loaded workflow keeps its saved size
    this.setDetails(this.node.properties?.[VIEW_PROPERTY] === "details");
    history.afterLoad().then(() => {
      if (this.node.vramcutView !== this) return;
      const known = history.known(this.node) ?? this.node.properties?.[LEGACY_PROPERTY];
      if (known) {
        history.remember(this.node, known);
        this.show(known, { restore: true });
        return;
      }
      history.fromHistory(this.node).then((p) => {
        if (!p || this.payload || this.node.vramcutView !== this) return;
        history.remember(this.node, p);
        this.show(p, { restore: true });
      });
    });
  }

  /** The user opened or closed the details: a choice kept with the workflow like any other edit. */
  chooseDetails(on) {
    const shown = this.fit.contentHeightNow();
    this.setDetails(on);
    const node = this.node;
    node.properties = node.properties || {};
    if (on) node.properties[VIEW_PROPERTY] = "details";
    else delete node.properties[VIEW_PROPERTY];
    this.fit.contentChanged({ shown });
  }

  /** Warn about outputs that lead nowhere (the node's links changed, or a frame looked). */
  checkLinks() {
    const linked = devicesLinked(this.node);
    const changed = linked !== this.devicesLinked;
    if (changed) {
      this.devicesLinked = linked;
      this.el.dataset.devicesLinked = String(linked);
      this.scheduleDraw();
    }
    if (this.setUnused(unusedOutputs(this.node)) || changed) this.fit.contentChanged();
  }

  setDetails(on) {
    this.details = !!on;
    this.detailsButton.textContent = on ? "less" : "details";
    this.detailsButton.title = on ? "Show the answer line and the VRAM bar only" : "Show every segment, the legend and all warnings";
    this.el.dataset.details = on ? "true" : "false";
    this.scheduleDraw();
  }

  setUnused(list) {
    const key = list.join(",");
    if (key === this.unused.join(",")) return false;
    this.unused = list;
    this.el.dataset.unused = key;
    this.scheduleDraw();
    return true;
  }

  updateDataset() {
    const s = summarize(this.payload);
    const d = this.el.dataset;
    d.segments = String(s.segments);
    d.resident = String(s.resident);
    d.streamed = String(s.streamed);
    d.idle = String(s.idle);
    d.stage = s.stage;
    d.stages = s.stages.join(",");
    d.models = String(s.models);
    d.hasPlan = this.payload ? "true" : "false";
    if (this.payload?.message) d.message = this.payload.message;
    else delete d.message;
    const refused = refusal(this.payload);
    if (refused?.fix) d.fix = refused.fix;
    else delete d.fix;
    d.state = refused ? "refused" : this.payload ? "plan" : "none";
    d.warnings = String((this.payload?.models ?? []).reduce((n, m) => n + m.warnings.length, 0));
    d.answers = (this.payload?.models ?? []).map((m) => answer(m, this.payload.budget_bytes, refusalFor(this.payload, m)).line).join("\n");
    d.unused = this.unused.join(",");
  }

  toggleTable(show = !this.showTable) {
    const shown = this.fit.contentHeightNow();
    this.showTable = show;
    this.pre.style.display = show ? "block" : "none";
    this.button.textContent = show ? "chart" : "table";
    this.button.title = show ? "Show the plan as a chart" : "Show the plan as a text table";
    this.el.dataset.view = show ? "table" : "chart";
    this.heightCache = null;
    this.scheduleDraw();
    this.fit.contentChanged({ shown }); // every row shown: the node as tall as the table
  }

  zoom() {
    return this.app.canvas?.ds?.scale ?? 1;
  }

  renderOptions() {
    return { reserveRight: (this.bar.offsetWidth || 110) + 6, details: this.details, zoom: this.zoom(), unused: this.unused,
      devicesLinked: !!this.devicesLinked };
  }

  /** Content height at a css width (at zoom 1), measured by the same pass that paints; with the
   * table shown, the table's whole height below the header. */
  contentHeight(width) {
    const W = Math.max(120, Math.round(width));
    const theme = readTheme(this.el);
    const key = `${W}|${theme.font}|${this.details}|${this.unused.join(",")}|${this.showTable}|${!!this.devicesLinked}`;
    if (this.heightCache?.payload !== this.payload || this.heightCache.key !== key) {
      const opts = { ...this.renderOptions(), zoom: 1 };
      const out = render(this.ctx, this.payload, W, theme, false, opts);
      const height = this.showTable ? Math.max(HEADER_H, out.headerH) + this.tableHeight(W) : out.height;
      this.heightCache = { payload: this.payload, key, height };
    }
    return this.heightCache.height;
  }

  /** The table's height at a css width: laid out off screen at that width, every row. */
  tableHeight(W) {
    const probe = this.pre.cloneNode(true);
    Object.assign(probe.style, { position: "fixed", left: "-10000px", top: "0", bottom: "auto", width: `${W}px`,
      height: "auto", display: "block", visibility: "hidden", overflowY: "visible" });
    document.body.append(probe);
    const h = Math.ceil(probe.getBoundingClientRect().height) + 2;
    probe.remove();
    return h;
  }

  scheduleDraw() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.draw();
    });
  }

  /** The canvas is CSS-scaled with the graph: draw at devicePixelRatio x zoom, so that one
   * canvas pixel is one screen pixel and text stays sharp when zoomed in or out. */
  pixelScale() {
    return (window.devicePixelRatio || 1) * Math.min(4, Math.max(0.25, this.zoom()));
  }

  draw() {
    const cssW = this.el.clientWidth;
    const cssH = this.el.clientHeight;
    if (!cssW || !cssH) return; // not mounted (collapsed, hidden, off-screen): drawn on next resize
    this.fit.drawn();
    const scale = this.pixelScale();
    const pw = Math.round(cssW * scale);
    const ph = Math.round(cssH * scale);
    if (this.canvas.width !== pw || this.canvas.height !== ph) {
      this.canvas.width = pw;
      this.canvas.height = ph;
    }
    this.drawnScale = scale;
    const ctx = this.ctx;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, pw, ph);
    ctx.setTransform(scale, 0, 0, scale, 0, 0);
    const theme = readTheme(this.el);
    const opts = this.renderOptions();
    this.drawnLow = opts.zoom < LOW_ZOOM;
    this.themeKey = theme.key;
    this.el.dataset.theme = theme.key;
    this.el.dataset.fg = theme.fg;
    this.el.dataset.zoomed = this.drawnLow ? "out" : "in";
    // the buttons and table only make sense where text is drawn
    this.bar.style.display = this.drawnLow ? "none" : "flex";
    const out = render(ctx, this.payload, cssW, theme, true, opts);
    this.regions = out.regions;
    this.texts = out.texts;
    this.bars = out.bars;
    // the table starts below the header, however many rows a narrow node gives it
    this.pre.style.top = `${Math.max(HEADER_H, out.headerH)}px`;
    this.el.dataset.drawn = String(Number(this.el.dataset.drawn || 0) + 1);
    this.el.dataset.contentHeight = String(out.height);
  }

  /** Called from the widget's onDraw (every LiteGraph frame): redraw when the zoom crossed a
   * threshold or the pixel scale changed, and (a few times a second) when the palette changed. */
  checkFrame() {
    this.fit.check();
    if (Math.abs(this.pixelScale() - this.drawnScale) > 0.01 || (this.zoom() < LOW_ZOOM) !== this.drawnLow) this.scheduleDraw();
    const now = performance.now();
    if (now - this.themeCheckedAt > 250) {
      this.themeCheckedAt = now;
      this.checkTheme();
      this.checkLinks();
    }
  }

  checkTheme() {
    if (this.el.isConnected && readTheme(this.el).key !== this.themeKey) this.scheduleDraw();
  }

  /** The tooltip for a point on the page, "" over the plan without one, null off the plan. */
  tipAt(clientX, clientY) {
    if (!this.el.isConnected || this.showTable || this.drawnLow) return null;
    const r = this.canvas.getBoundingClientRect();
    if (!r.width || clientX < r.left || clientX > r.right || clientY < r.top || clientY > r.bottom) return null;
    const k = this.el.clientWidth / r.width; // undo the graph's CSS zoom
    const x = (clientX - r.left) * k;
    const y = (clientY - r.top) * k;
    let tip = null;
    for (const g of this.regions) {
      if (x < g.x || x > g.x + g.w || y < g.y || y > g.y + g.h || g.section) continue;
      tip = g.tip;
    }
    return tip ?? "";
  }

  destroy() {
    this.onDestroy?.();
    this.onDestroy = null;
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    this.resizeObserver?.disconnect();
    this.resizeObserver = null;
    forgetView(this);
  }
}

/**
 * Gives a new Max VRAM node its plan: the view, its DOM widget (not saved with the workflow) and
 * the live plan events meant for it (`history`: the page's PlanHistory, which says which are).
 * `app`, `api`: ComfyUI's. Returns the view; `view.destroy()` undoes it all.
 */
export function attachPlan(node, app, api, history) {
  const view = new PlanView(node, app);
  node.vramcutView = view;
  const widget = node.addDOMWidget(WIDGET_NAME, "vramcut_plan", view.el, {
    serialize: false,
    hideOnZoom: false, // zoomed out the plan still answers (LiteGraph draws no text there)
    margin: MARGIN,
    getValue: () => "",
    setValue: () => {},
    getMinHeight: () => view.fit.minHeight(),
    onDraw: () => view.checkFrame(),
  });
  widget.serialize = false; // keep widgets_values to the real inputs
  node.vramcutWidget = widget;
  showThousandths(node);
  const onEvent = (e) => {
    const detail = e?.detail;
    if (!history.isFor(node, detail)) return;
    history.remember(node, detail.payload, { run: true });
    view.show(detail.payload);
  };
  api.addEventListener("vramcut.plan", onEvent);
  view.onDestroy = () => api.removeEventListener("vramcut.plan", onEvent);
  if (node.size[0] < MIN_NODE_WIDTH) node.setSize([MIN_NODE_WIDTH, node.size[1]]);
  requestAnimationFrame(() => !view.fit.settled && view.fit.fit());
  return view;
}
