// The plan's DOM widget: the canvas, the "details" / "table" buttons, the table, and the one
// tooltip every plan on the page shares.
//
// PlanView owns its element, its canvas and their observers, and schedules every redraw through
// requestAnimationFrame (one frame, however many changes); `destroy` undoes all of it. It owns
// the node's fit (fit.js) and asks it to fit whenever what it shows changes. Pointer events on
// the plan are handed to LiteGraph, so the plan acts like the rest of the node. `attachPlan`
// gives a new node its view, its widget and its live events.
// Rule: nothing happens at import (ComfyUI also loads this file on its own as an extension
// script): the page-wide listeners start in `watchPage()`, called by the extension, and ComfyUI's
// `app` comes in as an argument (its scripts/app.js is one folder further away from here).

import { normalizePayload, summarize } from "./payload.js";
import { answer, refusal, refusalFor } from "./format.js";
import { HEADER_H, LOW_ZOOM, render } from "./draw.js";
import { COLORS, FONT_FALLBACK, readTheme } from "./theme.js";
import { fillTable } from "./table.js";
import { MARGIN, MIN_NODE_WIDTH, NodeFit } from "./fit.js";
import { syncVueHeader, unusedOutputs } from "./node.js";

const WIDGET_NAME = "vramcut_plan";
const VIEW_PROPERTY = "vramcut_view";   // "details" when the user expanded the node (a user edit)
const LEGACY_PROPERTY = "vramcut_plan"; // older versions saved the plan here: still shown, never written
const BUDGET_WIDGETS = new Set(["max_vram_gb", "reserve_gb"]);

// One small styled tooltip for every plan on the page (a canvas `title` would be a raw dump in
// the browser's own font).
let tipEl = null;

function tooltip() {
  if (tipEl) return tipEl;
  tipEl = document.createElement("div");
  tipEl.className = "vramcut-tip";
  Object.assign(tipEl.style, {
    position: "fixed", zIndex: "10000", pointerEvents: "none", display: "none", maxWidth: "320px",
    padding: "6px 9px", borderRadius: "6px", whiteSpace: "pre-line",
    font: `500 12px/1.4 ${FONT_FALLBACK}`, color: "var(--fg-color, #eee)",
    background: "var(--comfy-menu-bg, #2b2b2b)", border: "1px solid var(--border-color, #4e4e4e)",
    boxShadow: "0 4px 14px rgba(0, 0, 0, 0.35)",
  });
  document.body.append(tipEl);
  return tipEl;
}

function showTip(text, clientX, clientY) {
  const t = tooltip();
  if (!text) {
    t.style.display = "none";
    return;
  }
  if (t.textContent !== text) t.textContent = text;
  t.style.display = "block";
  const r = t.getBoundingClientRect();
  const x = Math.min(clientX + 14, window.innerWidth - r.width - 6);
  const y = clientY + 18 + r.height > window.innerHeight ? clientY - r.height - 10 : clientY + 18;
  t.style.left = `${Math.max(4, x)}px`;
  t.style.top = `${Math.max(4, y)}px`;
}

// Hover is followed from the window (the plan hands its own pointer events to LiteGraph).
const views = new Set();
let tipOwner = null;
function hover(e) {
  let hit = null;
  for (const v of views) {
    const tip = v.tipAt(e.clientX, e.clientY);
    if (tip !== null) {
      hit = [v, tip];
      break;
    }
  }
  if (hit) {
    tipOwner = hit[0];
    showTip(hit[1], e.clientX, e.clientY);
  } else if (tipOwner) {
    tipOwner = null;
    showTip(null);
  }
}

// A palette switch changes the page's CSS variables (a class on <html>, its style, or a style
// sheet): redraw every plan whose colours no longer match, without waiting for the next plan.
let themeCheck = 0;
function onThemeMaybeChanged() {
  if (themeCheck) return;
  themeCheck = requestAnimationFrame(() => {
    themeCheck = 0;
    for (const v of views) v.checkTheme();
  });
}

let watching = false;

/** Start the page-wide listeners the plans share (hover, palette switches); once per page. */
export function watchPage() {
  if (watching) return;
  watching = true;
  window.addEventListener("pointermove", hover, { passive: true });
  new MutationObserver(onThemeMaybeChanged).observe(document.documentElement, { attributes: true, attributeFilter: ["class", "style"] });
  new MutationObserver(onThemeMaybeChanged).observe(document.head, { childList: true, subtree: true, characterData: true });
  window.addEventListener("pointerdown", () => tipOwner && showTip(null), { passive: true, capture: true });
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
    this.detailsButton = makeButton("details", "Show every segment, the legend and all warnings",
      () => this.chooseDetails(!this.details));
    this.detailsButton.className = "vramcut-plan-details";
    this.button = makeButton("table", "Show the plan as a text table", () => this.toggleTable());
    this.button.className = "vramcut-plan-toggle";
    bar.append(this.detailsButton, this.button);
    this.bar = bar;

    el.append(canvas, pre, bar);
    this.el = el;
    this.canvas = canvas;
    this.pre = pre;
    this.ctx = canvas.getContext("2d");

    // The host wraps the widget in an element that takes pointer events: hand them to LiteGraph's
    // canvas, so right-clicking and zooming on the plan act on the node and the graph as they do
    // anywhere else. LiteGraph treats a press on a widget as the widget's, never as a node drag,
    // so a left-button drag on the plan moves the node here. The buttons and the table keep theirs.
    const forward = (e) => {
      const target = this.app.canvas?.canvas;
      if (!target || e.target.closest?.("button, .vramcut-plan-table")) return;
      if (e.type === "pointerdown" && e.button === 0) return this.dragNode(e);
      if (e.type === "wheel" || e.type === "contextmenu" || e.type === "pointerdown") e.preventDefault();
      e.stopPropagation();
      const Ctor = e.type === "wheel" ? WheelEvent : e.type.startsWith("pointer") ? PointerEvent : MouseEvent;
      target.dispatchEvent(new Ctor(e.type, e));
      if (e.type === "pointermove") this.onPointerMove(e);
    };
    for (const type of ["pointerdown", "pointermove", "pointerup", "contextmenu", "wheel"])
      el.addEventListener(type, forward, { passive: false });

    this.resizeObserver = typeof ResizeObserver === "function" ? new ResizeObserver(() => this.scheduleDraw()) : null;
    this.resizeObserver?.observe(el);
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
   * server's history knows it (`history`: a PlanHistory). */
  restore(history) {
    this.fit.settle(); // a loaded workflow keeps its saved size
    this.setDetails(this.node.properties?.[VIEW_PROPERTY] === "details");
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
  }

  /** The user opened or closed the details: a choice kept with the workflow like any other edit. */
  chooseDetails(on) {
    this.setDetails(on);
    const node = this.node;
    node.properties = node.properties || {};
    if (on) node.properties[VIEW_PROPERTY] = "details";
    else delete node.properties[VIEW_PROPERTY];
    this.fit.contentChanged();
  }

  /** Warn about outputs that lead nowhere (the node's links changed, or a frame looked). */
  checkLinks() {
    if (this.setUnused(unusedOutputs(this.node))) this.fit.contentChanged();
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
    this.showTable = show;
    this.pre.style.display = show ? "block" : "none";
    this.button.textContent = show ? "chart" : "table";
    this.button.title = show ? "Show the plan as a chart" : "Show the plan as a text table";
    this.el.dataset.view = show ? "table" : "chart";
    this.heightCache = null;
    this.scheduleDraw();
    this.fit.contentChanged(); // every row shown: the node as tall as the table
  }

  zoom() {
    return this.app.canvas?.ds?.scale ?? 1;
  }

  renderOptions() {
    return { reserveRight: (this.bar.offsetWidth || 110) + 6, details: this.details, zoom: this.zoom(), unused: this.unused };
  }

  /** Content height at a css width (at zoom 1), measured by the same pass that paints; with the
   * table shown, the table's whole height below the header. */
  contentHeight(width) {
    const W = Math.max(120, Math.round(width));
    const theme = readTheme(this.el);
    const key = `${W}|${theme.font}|${this.details}|${this.unused.join(",")}|${this.showTable}`;
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

  onPointerMove(e) {
    hover(e);
  }

  /** Move the node with the pointer (selected and brought to the front, as LiteGraph does). */
  dragNode(e) {
    e.preventDefault();
    e.stopPropagation();
    const node = this.node;
    const lg = this.app.canvas;
    if (!lg) return;
    lg.selectNode?.(node, e.shiftKey || e.ctrlKey);
    lg.bringToFront?.(node);
    const scale = lg.ds?.scale || 1;
    const start = [e.clientX, e.clientY];
    const from = [node.pos[0], node.pos[1]];
    const el = this.el;
    try {
      el.setPointerCapture(e.pointerId);
    } catch {
      // a synthetic event has no pointer to capture: the moves still arrive while over the plan
    }
    const move = (ev) => {
      node.pos[0] = from[0] + (ev.clientX - start[0]) / scale;
      node.pos[1] = from[1] + (ev.clientY - start[1]) / scale;
      lg.setDirty?.(true, true);
      ev.stopPropagation();
    };
    const up = (ev) => {
      el.removeEventListener("pointermove", move, true);
      el.removeEventListener("pointerup", up, true);
      el.removeEventListener("pointercancel", up, true);
      try {
        el.releasePointerCapture(ev.pointerId);
      } catch {
        // already released
      }
      ev.stopPropagation();
      // the workflow changed like any node move (the change tracker sees it now, with an undo step)
      // (captureCanvasState on newer frontends, where checkState is deprecated)
      const ct = this.app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
      if (typeof ct?.captureCanvasState === "function") ct.captureCanvasState();
      else ct?.checkState?.();
    };
    el.addEventListener("pointermove", move, true);
    el.addEventListener("pointerup", up, true);
    el.addEventListener("pointercancel", up, true);
  }

  destroy() {
    this.onDestroy?.();
    this.onDestroy = null;
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    this.resizeObserver?.disconnect();
    this.resizeObserver = null;
    views.delete(this);
    if (tipOwner === this) showTip(null);
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
  // The budgets step by 0.05 GiB and round to 0.001 GiB; the host shows as many decimals as the
  // step has, so 0.001 read "0.00": show the three the rounding keeps.
  for (const w of node.widgets ?? []) {
    if (BUDGET_WIDGETS.has(w.name) && w.options) w.options.precision = 3;
  }
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
