// VRAMCut frontend: draws the plan the "Max VRAM (VRAMCut)" node sends.
//
// Python owns the plan; this file only draws it. Data arrives two ways:
//   - the node's output:  onExecuted(message) with message.vramcut = [PAYLOAD]
//   - live updates:       api event "vramcut.plan", detail = {node: "<id or a:b:id>", payload: PAYLOAD}
// PAYLOAD = {budget_bytes, enabled, message, models: [{kind, label, stage, signature, warnings,
//            text, plan: {budget_bytes, peak_bytes, streamed_bytes_per_forward, resident_bytes,
//            window_bytes, activation_reserve_bytes, measured, units, segments}}]}
// The last payload is kept in node.properties so a saved workflow shows its last plan again.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// Both Max VRAM nodes send the same payload (the second one is for upscale / CLIP vision models).
const NODE_TYPES = new Set(["VRAMCutMaxVRAM", "VRAMCutMaxVRAMExtras"]);
const EVENT = "vramcut.plan";
const PROPERTY = "vramcut_plan";
const WIDGET_NAME = "vramcut_plan";
const MARGIN = 6; // px around the widget inside the node
const MIN_NODE_WIDTH = 360;

// Blue/orange stays distinguishable for the common colour-vision deficiencies.
const COLORS = {
  resident: "#3b82f6",
  streamed: "#f59e0b",
  activation: "#a78bfa",
  idle: "#6b7280",
  over: "#ef4444",
  measured: "#16a34a",
  weightsOnly: "#64748b",
  warning: "#facc15",
  warningOnLight: "#b45309",
  message: "#ef4444",
};

const FONT_FALLBACK = "Inter, Arial, sans-serif";

// ---------------------------------------------------------------------------------- formatting

const KIB = 1024;
const MIB = 1024 ** 2;
const GIB = 1024 ** 3;

function fmtBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "—";
  const a = Math.abs(n);
  if (a >= GIB) return `${(n / GIB).toFixed(2)} GiB`;
  if (a >= MIB) return `${(n / MIB).toFixed(a >= 100 * MIB ? 0 : 1)} MiB`;
  if (a >= KIB) return `${(n / KIB).toFixed(1)} KiB`;
  return `${n} B`;
}

/** "double_blocks.0 … double_blocks.15" -> "double_blocks.0…15" */
function shortSegmentName(name) {
  const parts = String(name).split(" … ");
  if (parts.length !== 2) return String(name);
  const [a, b] = parts;
  const cut = a.lastIndexOf(".") + 1;
  if (cut > 0 && b.startsWith(a.slice(0, cut))) return `${a}…${b.slice(cut)}`;
  return `${a}…${b}`;
}

// ------------------------------------------------------------------------------------ payload

function asArray(v) {
  return Array.isArray(v) ? v : [];
}

/** Accept what Python sent; tolerate missing fields (never throw while drawing). */
function normalizePayload(p) {
  if (!p || typeof p !== "object") return null;
  const models = asArray(p.models)
    .filter((m) => m && typeof m === "object")
    .map((m) => {
      const plan = m.plan && typeof m.plan === "object" ? m.plan : {};
      return {
        kind: String(m.kind ?? "MODEL"),
        label: String(m.label ?? m.kind ?? "model"),
        stage: m.stage === "measured" ? "measured" : "weights",
        signature: m.signature ?? null,
        warnings: [...new Set([...asArray(m.warnings), ...asArray(plan.warnings)].map(String))],
        text: String(m.text ?? ""),
        plan: {
          ...plan,
          segments: asArray(plan.segments).filter((s) => s && typeof s === "object"),
          units: asArray(plan.units),
        },
      };
    });
  return {
    budget_bytes: p.budget_bytes ?? null,
    enabled: p.enabled !== false,
    message: p.message ? String(p.message) : null,
    message_level: p.message_level === "notice" ? "notice" : "error",
    models,
  };
}

// A segment that is not resident streams every step, unless the measured forward never ran it
// ("idle", e.g. the VAE encoder while decoding): the Python side marks those with idle: true.
function isStreamed(seg) {
  return !seg.resident && !seg.idle;
}

function isIdle(seg) {
  return !seg.resident && !!seg.idle;
}

function summarize(payload) {
  let segments = 0;
  let resident = 0;
  let streamed = 0;
  let idle = 0;
  const stages = [];
  for (const m of payload?.models ?? []) {
    segments += m.plan.segments.length;
    resident += m.plan.segments.filter((s) => s.resident).length;
    streamed += m.plan.segments.filter(isStreamed).length;
    idle += m.plan.segments.filter(isIdle).length;
    stages.push(m.stage);
  }
  let stage = "none";
  if (stages.length) {
    if (stages.every((s) => s === "measured")) stage = "measured";
    else if (stages.every((s) => s === "weights")) stage = "weights";
    else stage = "mixed";
  }
  return { segments, resident, streamed, idle, stage, stages, models: stages.length };
}

/** What goes into node.properties: the per-unit list is dropped (segments carry the names). */
function forStorage(payload) {
  if (!payload) return null;
  return {
    ...payload,
    models: payload.models.map((m) => ({
      ...m,
      plan: { ...m.plan, units: [], unit_count: unitCount(m.plan) },
    })),
  };
}

function unitCount(plan) {
  if (plan.units?.length) return plan.units.length;
  if (Number.isFinite(plan.unit_count)) return plan.unit_count;
  return plan.segments.reduce((n, s) => n + asArray(s.units).length, 0);
}

function allText(payload) {
  if (!payload) return "No plan yet: queue the workflow.";
  const parts = [];
  if (payload.message) parts.push(`!! ${payload.message}`);
  for (const m of payload.models) {
    let t = m.text || m.label;
    if (m.signature) t += `\ninput: ${m.signature}`;
    parts.push(t);
  }
  return parts.join("\n\n") || "No model connected.";
}

// ------------------------------------------------------------------------------------ drawing

function luminance(color) {
  const m = /^#?([0-9a-f]{3}|[0-9a-f]{6})$/i.exec(String(color).trim());
  if (!m) return 0;
  const h = m[1].length === 3 ? m[1].replace(/./g, "$&$&") : m[1];
  const [r, g, b] = [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16) / 255);
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

function readTheme(el) {
  const css = getComputedStyle(document.documentElement);
  const v = (name, fb) => css.getPropertyValue(name).trim() || fb;
  const font = getComputedStyle(el || document.body).fontFamily || FONT_FALLBACK;
  const light = luminance(v("--comfy-menu-bg", "#353535")) > 0.6;
  return {
    fg: v("--input-text", "#ddd"),
    strong: v("--fg-color", "#fff"),
    muted: v("--descrip-text", "#999"),
    track: v("--comfy-input-bg", "#222"),
    border: v("--border-color", "#4e4e4e"),
    warning: light ? COLORS.warningOnLight : COLORS.warning,
    font,
  };
}

function fitText(ctx, text, maxW) {
  text = String(text);
  if (maxW <= 0) return "";
  if (ctx.measureText(text).width <= maxW) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (ctx.measureText(text.slice(0, mid) + "…").width <= maxW) lo = mid;
    else hi = mid - 1;
  }
  return lo ? text.slice(0, lo) + "…" : "";
}

function wrapText(ctx, text, maxW, maxLines = 4) {
  const words = String(text).split(/\s+/).filter(Boolean);
  const lines = [];
  let cur = "";
  for (const w of words) {
    const next = cur ? `${cur} ${w}` : w;
    if (ctx.measureText(next).width <= maxW || !cur) cur = next;
    else {
      lines.push(cur);
      cur = w;
    }
  }
  if (cur) lines.push(cur);
  if (lines.length > maxLines) {
    const kept = lines.slice(0, maxLines);
    kept[maxLines - 1] = fitText(ctx, lines.slice(maxLines - 1).join(" "), maxW);
    return kept;
  }
  return lines.map((l) => fitText(ctx, l, maxW));
}

function roundRect(ctx, x, y, w, h, r) {
  r = Math.max(0, Math.min(r, w / 2, h / 2));
  ctx.beginPath();
  ctx.moveTo(x + r, y);
  ctx.arcTo(x + w, y, x + w, y + h, r);
  ctx.arcTo(x + w, y + h, x, y + h, r);
  ctx.arcTo(x, y + h, x, y, r);
  ctx.arcTo(x, y, x + w, y, r);
  ctx.closePath();
}

/**
 * Lays out and (when `paint`) draws the payload at css width W. Returns the height used and
 * hover regions [{x, y, w, h, tip}]. The same pass measures and paints, so the node's minimum
 * height always matches what is drawn.
 */
function render(ctx, payload, W, theme, paint, reserveRight = 0) {
  const regions = [];
  const f = (size, weight = 400) => `${weight} ${size}px ${theme.font}`;
  const text = (s, x, y, color, font, align = "left") => {
    if (!paint) return;
    ctx.font = font;
    ctx.fillStyle = color;
    ctx.textAlign = align;
    ctx.textBaseline = "middle";
    ctx.fillText(s, x, y);
  };
  const rect = (x, y, w, h, color) => {
    if (!paint || w <= 0 || h <= 0) return;
    ctx.fillStyle = color;
    ctx.fillRect(x, y, w, h);
  };
  let y = 0;

  // Header: what this is, the budget, and room for the table toggle at the right.
  ctx.font = f(12, 700);
  const head = "VRAM plan";
  const headW = ctx.measureText(head).width;
  text(head, 0, y + 9, theme.strong, f(12, 700));
  if (payload) {
    const s = summarize(payload);
    const budget = payload.budget_bytes != null ? `budget ${fmtBytes(payload.budget_bytes)}` : "budget —";
    ctx.font = f(11);
    const sub = fitText(ctx, `${budget} · ${s.models} model${s.models === 1 ? "" : "s"}`,
      W - headW - 10 - reserveRight);
    text(sub, headW + 8, y + 9, theme.muted, f(11));
  }
  y += 22;

  // A message Python wants seen (budget too small, ...): a tinted box with a round "!" mark,
  // drawn rather than an emoji so it looks the same without emoji fonts.
  const banner = (msg, color) => {
    ctx.font = f(12, 600);
    const lines = wrapText(ctx, msg, W - 34, 6);
    const h = Math.max(26, lines.length * 15 + 10);
    if (paint) {
      ctx.save();
      ctx.globalAlpha = 0.22;
      roundRect(ctx, 0, y, W, h, 4);
      ctx.fillStyle = color;
      ctx.fill();
      ctx.restore();
      roundRect(ctx, 0.5, y + 0.5, W - 1, h - 1, 4);
      ctx.strokeStyle = color;
      ctx.lineWidth = 1;
      ctx.stroke();
      ctx.beginPath();
      ctx.arc(14, y + 13, 8, 0, 2 * Math.PI);
      ctx.fillStyle = color;
      ctx.fill();
    }
    text("!", 14, y + 13.5, "#fff", f(12, 800), "center");
    lines.forEach((l, i) => text(l, 28, y + 5 + 7.5 + i * 15, theme.strong, f(12, 600)));
    regions.push({ x: 0, y, w: W, h, tip: msg });
    y += h + 6;
  };

  if (!payload) {
    ctx.font = f(11);
    for (const l of wrapText(ctx, "Queue the workflow to see which blocks stay on the GPU and which are streamed.", W, 3)) {
      text(l, 0, y + 7, theme.muted, f(11));
      y += 15;
    }
    return { height: y + 2, regions };
  }
  // Red: something went wrong. Grey: a notice (VRAMCut off, or Python says message_level "notice").
  if (payload.message) {
    const notice = !payload.enabled || payload.message_level === "notice";
    banner(payload.message, notice ? COLORS.weightsOnly : COLORS.message);
  }
  if (!payload.enabled && !payload.message) banner("VRAMCut is off: the models pass through unchanged.", COLORS.weightsOnly);
  if (!payload.models.length && !payload.message) {
    text("No model connected.", 0, y + 7, theme.muted, f(11));
    y += 18;
  }

  payload.models.forEach((m, idx) => {
    const plan = m.plan;
    const segs = plan.segments;
    const top = y;
    if (idx > 0 && paint) rect(0, y, W, 1, theme.border);
    if (idx > 0) y += 6;

    // Title row: label + stage badge.
    const measured = m.stage === "measured";
    const badge = measured ? "measured" : "weights only";
    ctx.font = f(10, 700);
    const bw = ctx.measureText(badge).width + 10;
    if (paint) {
      roundRect(ctx, W - bw, y + 1, bw, 15, 7);
      ctx.fillStyle = measured ? COLORS.measured : COLORS.weightsOnly;
      ctx.fill();
    }
    text(badge, W - bw / 2, y + 9, "#fff", f(10, 700), "center");
    ctx.font = f(12, 600);
    text(fitText(ctx, m.label, W - bw - 8), 0, y + 9, theme.strong, f(12, 600));
    regions.push({ x: W - bw, y, w: bw, h: 17, tip: measured
      ? `Measured: activations recorded for input ${m.signature ?? "(this signature)"}`
      : "Weights only: activations are not measured yet; the plan is refined on the first run" });
    y += 20;

    // Two rows share a left gutter with their captions: "VRAM" is the device at the plan's
    // peak against the budget line; "blocks" is the model in execution order, one bar per
    // segment, as wide as its weights, activations stacked on top once measured.
    ctx.font = f(10, 600);
    const GX = Math.ceil(Math.max(ctx.measureText("VRAM").width, ctx.measureText("blocks").width)) + 6;
    const CW = Math.max(40, W - GX);

    const budget = Number(plan.budget_bytes ?? payload.budget_bytes ?? 0);
    const peak = Number(plan.peak_bytes ?? 0);
    const res = Number(plan.resident_bytes ?? 0);
    const win = Number(plan.window_bytes ?? 0);
    const act = plan.activation_reserve_bytes == null ? null : Number(plan.activation_reserve_bytes);
    const scale = Math.max(budget, peak, res + win + (act ?? 0), 1);
    const barH = 14;
    const bx = (b) => GX + (b / scale) * CW;
    text("VRAM", 0, y + barH / 2, theme.muted, f(10, 600));
    if (paint) {
      ctx.save();
      roundRect(ctx, GX, y, bx(budget) - GX, barH, 3);
      ctx.fillStyle = theme.track;
      ctx.fill();
      ctx.strokeStyle = theme.border;
      ctx.lineWidth = 1;
      ctx.stroke();
      ctx.restore();
    }
    let x = GX;
    for (const [bytes, color] of [[res, COLORS.resident], [win, COLORS.streamed], [act ?? 0, COLORS.activation]]) {
      const w = bx(bytes) - GX;
      rect(x, y + 1, w, barH - 2, color);
      x += w;
    }
    const over = budget > 0 && peak > budget;
    if (over && paint) {
      ctx.strokeStyle = COLORS.over;
      ctx.lineWidth = 2;
      ctx.strokeRect(bx(budget), y, bx(peak) - bx(budget), barH);
    }
    if (budget > 0) {
      const lx = Math.min(W - 1, Math.max(GX + 1, bx(budget)));
      rect(lx - 1, y - 3, 2, barH + 6, theme.strong);
    }
    regions.push({ x: 0, y: y - 3, w: W, h: barH + 6, tip:
      `VRAM at the plan's peak: ${fmtBytes(peak)} = resident ${fmtBytes(res)} + streaming window ${fmtBytes(win)}` +
      ` + activations ${act == null ? "not measured yet" : fmtBytes(act)}\nbudget ${fmtBytes(budget)} (the white line)` });
    y += barH + 4;

    // Totals.
    const streamedBytes = Number(plan.streamed_bytes_per_forward ?? 0);
    const peakText = `peak ${act == null ? "≥" : ""}${fmtBytes(peak)} of ${fmtBytes(budget)}`;
    const streamText = streamedBytes > 0 ? `streams ${fmtBytes(streamedBytes)} / step` : "all resident";
    text(peakText, GX, y + 7, over ? COLORS.over : theme.fg, f(11, over ? 700 : 500));
    ctx.font = f(11, 500);
    const peakW = ctx.measureText(peakText).width;
    text(fitText(ctx, streamText, CW - peakW - 10), W, y + 7, theme.fg, f(11, 500), "right");
    y += 18;

    const actH = segs.some((s) => Number(s.activation_bytes) > 0) ? 12 : 0;
    const wH = 20;
    text("blocks", 0, y + actH + wH / 2, theme.muted, f(10, 600));
    const total = segs.reduce((n, s) => n + Math.max(0, Number(s.weight_bytes) || 0), 0);
    const maxAct = Math.max(1, ...segs.map((s) => Number(s.activation_bytes) || 0));
    const gap = segs.length && CW / segs.length >= 4 ? 1 : 0;
    // widths follow the bytes; tiny segments still get a sliver (at most 15% of the width in
    // all goes to these minimums, so the proportions stay true)
    const minW = Math.min(2, (0.15 * CW) / Math.max(1, segs.length));
    const free = Math.max(0, CW - minW * segs.length);
    let sx = GX;
    ctx.font = f(10, 600);
    segs.forEach((s, i) => {
      const wb = Math.max(0, Number(s.weight_bytes) || 0);
      const sw = minW + (total > 0 ? (wb / total) * free : free / segs.length);
      const color = s.resident ? COLORS.resident : s.idle ? COLORS.idle : COLORS.streamed;
      const drawW = sw - (sw > 2 ? gap : 0);
      rect(sx, y + actH, drawW, wH, color);
      const a = Number(s.activation_bytes) || 0;
      if (actH && a > 0) {
        const h = Math.max(1, (a / maxAct) * (actH - 1));
        rect(sx, y + actH - 1 - h, drawW, h, COLORS.activation);
      }
      if (paint && drawW > 34) {
        const fitted = fitText(ctx, shortSegmentName(s.name), drawW - 6);
        if (fitted) text(fitted, sx + 3, y + actH + wH / 2, "#fff", f(10, 600));
      }
      const nUnits = asArray(s.units).length;
      regions.push({ x: sx, y, w: sw, h: actH + wH, tip:
        `#${i} ${s.name}\n${s.resident ? "resident: stays on the GPU" : s.idle ? "idle: not run by this forward" : "streamed: copied to the GPU every step"}` +
        `\nweights ${fmtBytes(wb)} · activations ${s.activation_bytes == null ? "not measured" : fmtBytes(a)}` +
        (nUnits > 1 ? `\n${nUnits} blocks` : "") });
      sx += sw;
    });
    if (!segs.length) text("no segments", GX, y + actH + wH / 2, theme.muted, f(11));
    y += actH + wH + 4;

    // Counts and the input signature.
    const nRes = segs.filter((s) => s.resident).length;
    const nStr = segs.filter(isStreamed).length;
    const nIdle = segs.filter(isIdle).length;
    let counts = `${nRes} resident · ${nStr} streamed` + (nIdle ? ` · ${nIdle} idle` : "") +
      ` segments · ${unitCount(plan)} blocks`;
    if (m.signature) counts += ` · ${m.signature}`;
    ctx.font = f(10);
    text(fitText(ctx, counts, CW), GX, y + 6, theme.muted, f(10));
    y += 14;

    // Warnings, prominently.
    ctx.font = f(11, 600);
    for (const w of m.warnings) {
      const lines = wrapText(ctx, `⚠ ${w}`, W, 3);
      const h0 = y;
      for (const l of lines) {
        text(l, 0, y + 7, theme.warning, f(11, 600));
        y += 14;
      }
      regions.push({ x: 0, y: h0, w: W, h: y - h0, tip: w });
    }
    regions.push({ x: 0, y: top, w: W, h: y - top, tip: m.text || m.label, section: true });
    y += 4;
  });

  // Legend, once.
  if (payload.models.length) {
    let lx = 0;
    const items = [["resident", COLORS.resident], ["streamed", COLORS.streamed], ["activations", COLORS.activation]];
    if (summarize(payload).idle) items.push(["idle", COLORS.idle]);
    ctx.font = f(10);
    for (const [name, color] of items) {
      rect(lx, y + 2, 9, 9, color);
      text(name, lx + 12, y + 7, theme.muted, f(10));
      lx += 12 + ctx.measureText(name).width + 10;
    }
    rect(lx + 3, y, 2, 13, theme.strong);
    text("budget", lx + 9, y + 7, theme.muted, f(10));
    y += 16;
  }
  return { height: Math.ceil(y + 2), regions };
}

// ---------------------------------------------------------------------------------- the widget

class PlanView {
  constructor(node) {
    this.node = node;
    this.payload = null;
    this.regions = [];
    this.frame = 0;
    this.showTable = false;
    this.drawnScale = 0;

    const el = document.createElement("div");
    el.className = "vramcut-plan";
    Object.assign(el.style, {
      position: "relative", width: "100%", height: "100%", boxSizing: "border-box",
      overflow: "hidden", fontFamily: FONT_FALLBACK,
    });
    el.dataset.residentColor = COLORS.resident;
    el.dataset.streamedColor = COLORS.streamed;

    const canvas = document.createElement("canvas");
    canvas.className = "vramcut-plan-canvas";
    Object.assign(canvas.style, { display: "block", width: "100%", height: "100%" });

    const pre = document.createElement("pre");
    pre.className = "vramcut-plan-table";
    Object.assign(pre.style, {
      display: "none", position: "absolute", left: "0", right: "0", top: "22px", bottom: "0",
      margin: "0", padding: "4px", overflow: "auto", whiteSpace: "pre",
      font: "10px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)",
      border: "1px solid var(--border-color, #4e4e4e)", borderRadius: "4px", boxSizing: "border-box",
    });

    const button = document.createElement("button");
    button.className = "vramcut-plan-toggle";
    button.type = "button";
    button.textContent = "table";
    button.title = "Show the plan as a text table";
    Object.assign(button.style, {
      position: "absolute", right: "0", top: "0", height: "18px", padding: "0 7px",
      font: `600 10px ${FONT_FALLBACK}`, lineHeight: "16px", cursor: "pointer",
      color: "var(--input-text, #ddd)", background: "var(--comfy-input-bg, #222)",
      border: "1px solid var(--border-color, #4e4e4e)", borderRadius: "9px",
    });
    button.addEventListener("click", (e) => {
      e.stopPropagation();
      this.toggleTable();
    });

    canvas.addEventListener("mousemove", (e) => this.onHover(e));
    // The widget sits above LiteGraph's canvas: hand the wheel back so zooming still works.
    canvas.addEventListener("wheel", (e) => {
      const target = app.canvas?.canvas;
      if (!target) return;
      e.preventDefault();
      target.dispatchEvent(new WheelEvent(e.type, e));
    }, { passive: false });

    el.append(canvas, pre, button);
    this.el = el;
    this.canvas = canvas;
    this.pre = pre;
    this.button = button;
    this.ctx = canvas.getContext("2d");

    this.resizeObserver = typeof ResizeObserver === "function" ? new ResizeObserver(() => this.scheduleDraw()) : null;
    this.resizeObserver?.observe(el);
    this.updateDataset();
  }

  setPayload(payload) {
    this.payload = normalizePayload(payload);
    this.pre.textContent = allText(this.payload);
    this.updateDataset();
    this.scheduleDraw();
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
    d.warnings = String((this.payload?.models ?? []).reduce((n, m) => n + m.warnings.length, 0));
  }

  toggleTable(show = !this.showTable) {
    this.showTable = show;
    this.pre.style.display = show ? "block" : "none";
    this.button.textContent = show ? "chart" : "table";
    this.button.title = show ? "Show the plan as a chart" : "Show the plan as a text table";
    this.el.dataset.view = show ? "table" : "chart";
    this.scheduleDraw();
  }

  /** Content height at a css width, measured by the same pass that paints. */
  contentHeight(width) {
    const W = Math.max(120, Math.round(width));
    const theme = readTheme(this.el);
    const key = `${W}|${theme.font}`;
    if (this.heightCache?.payload !== this.payload || this.heightCache.key !== key) {
      this.heightCache = { payload: this.payload, key, height: render(this.ctx, this.payload, W, theme, false, 52).height };
    }
    return this.heightCache.height;
  }

  scheduleDraw() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.draw();
    });
  }

  /** The canvas is CSS-scaled with the graph: draw at devicePixelRatio x zoom to stay sharp. */
  pixelScale() {
    const zoom = app.canvas?.ds?.scale ?? 1;
    return (window.devicePixelRatio || 1) * Math.min(4, Math.max(1, zoom));
  }

  draw() {
    const cssW = this.el.clientWidth;
    const cssH = this.el.clientHeight;
    if (!cssW || !cssH) return; // not mounted (collapsed, hidden, off-screen): drawn on next resize
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
    const out = render(ctx, this.payload, cssW, readTheme(this.el), true, 52);
    this.regions = out.regions;
    this.el.dataset.drawn = String(Number(this.el.dataset.drawn || 0) + 1);
    if (out.height > cssH + 1) this.node.vramcutFit?.();
  }

  /** Called from the widget's onDraw (every LiteGraph frame): redraw when the zoom changed. */
  checkScale() {
    if (Math.abs(this.pixelScale() - this.drawnScale) > 0.01) this.scheduleDraw();
  }

  onHover(e) {
    const r = this.canvas.getBoundingClientRect();
    if (!r.width || !this.el.clientWidth) return;
    const k = this.el.clientWidth / r.width; // undo the graph's CSS zoom
    const x = (e.clientX - r.left) * k;
    const y = (e.clientY - r.top) * k;
    let tip = null;
    let section = null;
    for (const g of this.regions) {
      if (x < g.x || x > g.x + g.w || y < g.y || y > g.y + g.h) continue;
      if (g.section) section = section ?? g.tip;
      else if (g.tip) tip = g.tip;
    }
    const title = tip ?? section ?? allText(this.payload);
    if (this.canvas.title !== title) this.canvas.title = title;
  }

  destroy() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    this.resizeObserver?.disconnect();
    this.resizeObserver = null;
  }
}

// -------------------------------------------------------------------------------- node wiring

/** True when an event for `target` ("7", or a subgraph path "12:7") is meant for this node. */
function eventIsFor(node, target) {
  if (target === undefined || target === null) return false;
  const id = String(node.id);
  const t = String(target);
  return t === id || t.split(":").pop() === id;
}

// The prompt the server is running now (from its "execution_start" event). A plan event carries
// the prompt it was sent for; one from another prompt (a model of an earlier run releasing its
// buffers, say) is not for the nodes on screen, even when a node id matches.
let runningPrompt = null;
api.addEventListener("execution_start", (e) => {
  runningPrompt = e?.detail?.prompt_id ?? null;
});

function isCurrentPrompt(detail) {
  return !detail.prompt_id || !runningPrompt || detail.prompt_id === runningPrompt;
}

function lastPayload(list) {
  if (Array.isArray(list)) return list.length ? list[list.length - 1] : null;
  return list && typeof list === "object" ? list : null;
}

app.registerExtension({
  name: "vramcut.MaxVRAM",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.has(nodeData?.name)) return;
    const proto = nodeType.prototype;

    const onNodeCreated = proto.onNodeCreated;
    proto.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      const node = this;
      const view = new PlanView(node);
      node.vramcutView = view;

      const widget = node.addDOMWidget(WIDGET_NAME, "vramcut_plan", view.el, {
        serialize: false,
        hideOnZoom: true,
        margin: MARGIN,
        getValue: () => "",
        setValue: () => {},
        getMinHeight: () => view.contentHeight((node.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN),
        onDraw: () => view.checkScale(),
      });
      widget.serialize = false; // keep widgets_values to the real inputs
      node.vramcutWidget = widget;

      node.vramcutFit = () => {
        // Fit the plan: grow to show all of it; shrink back only while the node still has the
        // size this code gave it (a size the user chose is kept).
        const min = node.computeSize();
        const auto = node.vramcutAutoSize;
        const untouched = auto && auto[0] === node.size[0] && auto[1] === node.size[1];
        const w = Math.max(node.size[0], min[0], MIN_NODE_WIDTH);
        const h = untouched ? min[1] : Math.max(node.size[1], min[1]);
        if (w !== node.size[0] || h !== node.size[1]) {
          node.setSize([w, h]);
          node.vramcutAutoSize = [node.size[0], node.size[1]];
        }
        node.setDirtyCanvas?.(true, true);
      };

      node.vramcutOnEvent = (e) => {
        const detail = e?.detail;
        if (!detail || !eventIsFor(node, detail.node) || !isCurrentPrompt(detail)) return;
        node.vramcutShow(detail.payload);
      };
      api.addEventListener(EVENT, node.vramcutOnEvent);

      if (node.size[0] < MIN_NODE_WIDTH) node.setSize([MIN_NODE_WIDTH, node.size[1]]);
      // A loaded workflow's configure() replaces this size with the saved one, which is kept.
      node.vramcutAutoSize = [node.size[0], node.size[1]];
      requestAnimationFrame(() => node.vramcutFit?.());
      return r;
    };

    proto.vramcutShow = function (payload, { store = true } = {}) {
      const view = this.vramcutView;
      if (!view) return;
      view.setPayload(payload);
      if (store) {
        this.properties = this.properties || {};
        this.properties[PROPERTY] = forStorage(view.payload);
      }
      this.vramcutFit?.();
    };

    const onExecuted = proto.onExecuted;
    proto.onExecuted = function (message) {
      const r = onExecuted?.apply(this, arguments);
      const payload = lastPayload(message?.vramcut);
      if (payload) this.vramcutShow(payload);
      return r;
    };

    const onConfigure = proto.onConfigure;
    proto.onConfigure = function (info) {
      const r = onConfigure?.apply(this, arguments);
      const saved = this.properties?.[PROPERTY];
      if (saved && this.vramcutView) this.vramcutShow(saved, { store: false });
      return r;
    };

    const onRemoved = proto.onRemoved;
    proto.onRemoved = function () {
      if (this.vramcutOnEvent) api.removeEventListener(EVENT, this.vramcutOnEvent);
      this.vramcutOnEvent = null;
      this.vramcutView?.destroy();
      return onRemoved?.apply(this, arguments);
    };
  },
});

