// VRAMCut frontend: draws the plan the "Max VRAM (VRAMCut)" node sends.
//
// Python owns the plan; this file only draws it. Data arrives two ways:
//   - the node's output:  onExecuted(message) with message.vramcut = [PAYLOAD]
//   - live updates:       api event "vramcut.plan", detail = {node: "<id or a:b:id>", payload: PAYLOAD}
// PAYLOAD = {budget_bytes, enabled, message, min_budget_bytes?, need_bytes?, models: [{kind, label,
//            stage, signature, warnings, text, plan: {budget_bytes, peak_bytes,
//            streamed_bytes_per_forward, transfers_per_forward, resident_bytes, window_bytes,
//            activation_reserve_bytes, measured, units, segments, stats?, cost?}}]}
// plan.cost (vramcut_core/report.py cost_to_json) carries the answer line's figures: fits, blocks
// streamed, the bytes and transfers (copies) per step, and the time streaming adds per step,
// measured after a run or estimated before one.
//
// A plan is never written into the workflow (node.properties): a run with no edit must not mark
// a saved workflow as changed. After a reload the plan comes back from the server's /history.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// Both Max VRAM nodes send the same payload (the second one is for upscale / CLIP vision models).
const NODE_TYPES = new Set(["VRAMCutMaxVRAM", "VRAMCutMaxVRAMExtras"]);
const EVENT = "vramcut.plan";
const LEGACY_PROPERTY = "vramcut_plan"; // older versions saved the plan here: still shown, never written
const VIEW_PROPERTY = "vramcut_view";   // "details" when the user expanded the node (a user edit)
const WIDGET_NAME = "vramcut_plan";
const MARGIN = 6; // px around the widget inside the node
const MIN_NODE_WIDTH = 360;
const MIN_WIDGET_HEIGHT = 24; // the node can be shrunk down to the header row
const LOW_ZOOM = 0.6;         // LiteGraph draws no text below this scale: the plan keeps its answer
const READABLE_PX = 11;       // on-screen text size the low-zoom view aims for
const HISTORY_ITEMS = 64;

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
  fits: "#22c55e",
  fitsOnLight: "#15803d",
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

/** GiB as the max_vram_gb widget speaks it: 2 decimals, 3 below 0.1 GiB. */
function gib(n, digits) {
  if (n === null || n === undefined || !Number.isFinite(Number(n))) return "—";
  const g = Number(n) / GIB;
  return g.toFixed(digits ?? (Math.abs(g) < 0.1 ? 3 : 2));
}

/** The smallest max_vram_gb (rounded up to the widget's 0.01 step) that holds `bytes`. */
function gibCeil(bytes) {
  return (Math.ceil((Number(bytes) / GIB) * 100 - 1e-9) / 100).toFixed(2);
}

function pct(a, b) {
  return b > 0 ? `${Math.round((100 * a) / b)} %` : "—";
}

function fmtSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(Number(s))) return "?";
  s = Number(s);
  if (s >= 10) return `${s.toFixed(0)} s`;
  if (s >= 0.095) return `${s.toFixed(2)} s`;
  if (s >= 0.0005) return `${(s * 1000).toFixed(s >= 0.01 ? 0 : 1)} ms`;
  return "0 s";
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

/** The dotted prefix every segment name of a model shares ("joint_blocks."), or "". */
function sharedPrefix(names) {
  if (names.length < 2) return "";
  let p = names[0];
  for (const n of names) while (p && !n.startsWith(p)) p = p.slice(0, -1);
  const cut = p.lastIndexOf(".") + 1;
  return cut > 0 ? p.slice(0, cut) : "";
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
          cost: plan.cost && typeof plan.cost === "object" ? plan.cost : null,
        },
      };
    });
  const positive = (v) => (Number.isFinite(Number(v)) && Number(v) > 0 ? Number(v) : null);
  return {
    budget_bytes: p.budget_bytes ?? null,
    enabled: p.enabled !== false,
    message: p.message ? String(p.message) : null,
    message_level: p.message_level === "notice" ? "notice" : "error",
    min_budget_bytes: positive(p.min_budget_bytes),
    need_bytes: positive(p.need_bytes),
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

function unitCount(plan) {
  if (plan.units?.length) return plan.units.length;
  if (Number.isFinite(plan.unit_count)) return plan.unit_count;
  return plan.segments.reduce((n, s) => n + asArray(s.units).length, 0);
}

/**
 * The answer to "will it fit, and what does it cost?" for one model, from the figures Python
 * sent (plan.cost; older payloads without it get the counts from the segments, and no time).
 * Returns the parts, so the line can be drawn with the verdict coloured, and short forms.
 */
function answer(m, payloadBudget) {
  const plan = m.plan;
  const c = plan.cost ?? {};
  const budget = Number(plan.budget_bytes ?? payloadBudget ?? 0);
  const peak = Number(plan.peak_bytes ?? 0);
  const fits = c.fits ?? (budget > 0 && peak <= budget);
  const lower = c.peak_is_lower_bound ?? plan.activation_reserve_bytes == null;
  const blocks = Number.isFinite(c.blocks) ? c.blocks : unitCount(plan);
  const streamedBlocks = Number.isFinite(c.blocks_streamed) ? c.blocks_streamed
    : plan.segments.filter(isStreamed).reduce((n, s) => n + asArray(s.units).length, 0);
  const verdict = fits ? "fits" : "over budget";
  const vram = `${lower ? "≥" : ""}${gib(peak, budget < 0.1 * GIB ? 3 : 2)} / ${gib(budget)} GiB (${pct(peak, budget)})`;
  const stream = streamedBlocks > 0 ? `${streamedBlocks} of ${blocks} blocks streamed` : `all ${blocks} blocks resident`;
  const source = c.added_source ?? null;
  // a diffusion model runs one forward per sampling step; encoders and VAEs one per call
  const per = m.kind === "MODEL" ? "step" : "call";
  let time;
  if (streamedBlocks === 0 && (source === null || source === "estimate")) time = `+0 s / ${per}`;
  else if (source === "measured") time = `+${fmtSeconds(c.added_s_per_forward)} / ${per}`;
  else if (source === "estimate") time = `+${fmtSeconds(c.added_s_per_forward)} / ${per} (estimate)`;
  else time = "time not measured";
  const short = `${verdict} ${pct(peak, budget)} · ${source ? `+${fmtSeconds(c.added_s_per_forward)}/${per}` : stream}`;
  return { fits, verdict, vram, stream, time, source, short, line: `${verdict} · ${vram} · ${stream} · ${time}` };
}

function costTip(m) {
  const c = m.plan.cost;
  if (!c) return "The added time is not known: this plan came from an older version.";
  const bw = c.bandwidth_bytes_per_s ? `${(c.bandwidth_bytes_per_s / GIB).toFixed(1)} GiB/s` : "not measured";
  const where = c.bandwidth_device === "cpu" ? "a memory copy on this CPU" : `host to ${c.bandwidth_device ?? "device"}`;
  const lines = [];
  if (c.added_source === "measured") {
    lines.push(`Measured over ${c.measured_forwards} forward${c.measured_forwards === 1 ? "" : "s"}: ` +
      `compute waited ${fmtSeconds(c.measured_s_per_forward)} per forward for copies.`);
    lines.push(`copies ${fmtSeconds(c.measured_copy_s_per_forward)} · compute ${fmtSeconds(c.measured_compute_s_per_forward)} per forward`);
  } else {
    lines.push(`Estimate until a run measures it: ${fmtBytes(c.streamed_bytes_per_forward)} streamed per forward ÷ ${bw}.`);
  }
  if (Number.isFinite(c.transfers_per_forward) && c.streamed_bytes_per_forward > 0) {
    const t = c.transfers_per_forward;
    lines.push(`${fmtBytes(c.streamed_bytes_per_forward)} streamed per forward in ${t} transfer${t === 1 ? "" : "s"} ` +
      `(adjacent streamed blocks are copied together).`);
  }
  lines.push(`Bandwidth ${bw} (${where}, measured once on this machine).`);
  return lines.join("\n");
}

function allText(payload) {
  if (!payload) return "No plan yet: queue the workflow.";
  const parts = [];
  if (payload.message) parts.push(`!! ${payload.message}`);
  for (const m of payload.models) {
    let t = `${m.label}\n${answer(m, payload.budget_bytes).line}\n\n${m.text || ""}`;
    if (m.signature) t += `\ninput: ${m.signature}`;
    parts.push(t);
  }
  return parts.join("\n\n") || "No model connected.";
}

/** The fix for a budget that is too small, from what the error carried. */
function budgetFix(payload) {
  if (payload.min_budget_bytes) return `Set max_vram_gb to at least ${gibCeil(payload.min_budget_bytes)} (the smallest budget that works).`;
  if (payload.need_bytes) return `Set max_vram_gb above ${gibCeil(payload.need_bytes)}: one block alone needs ${gib(payload.need_bytes)} GiB.`;
  return null;
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
  const t = {
    fg: v("--input-text", "#ddd"),
    strong: v("--fg-color", "#fff"),
    muted: v("--descrip-text", "#999"),
    track: v("--comfy-input-bg", "#222"),
    border: v("--border-color", "#4e4e4e"),
    warning: light ? COLORS.warningOnLight : COLORS.warning,
    fits: light ? COLORS.fitsOnLight : COLORS.fits,
    light,
    font,
  };
  t.key = [t.fg, t.strong, t.muted, t.track, t.border, t.light, t.font].join("|");
  return t;
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

const HEADER_H = 22;

/**
 * Lays out and (when `paint`) draws the payload at css width W. Returns the height used and
 * hover regions [{x, y, w, h, tip}]. The same pass measures and paints, so the height the node
 * grows to always matches what is drawn. opts: {reserveRight, details, zoom, unused}.
 */
function render(ctx, payload, W, theme, paint, opts = {}) {
  const { reserveRight = 0, details = false, zoom = 1, unused = [] } = opts;
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
  const unusedText = unused.length
    ? `${unused.join(", ")} output${unused.length > 1 ? "s are" : " is"} not connected: the plan never applies. ` +
      "Take the model from this node's output."
    : null;
  let y = 0;

  // Zoomed out, LiteGraph draws no text: keep the answer, one big line per model.
  if (zoom < LOW_ZOOM) {
    const size = Math.min(40, Math.max(13, READABLE_PX / Math.max(zoom, 0.05)));
    const line = (s, color) => {
      ctx.font = f(size, 700);
      text(fitText(ctx, s, W), 0, y + size * 0.65, color, f(size, 700));
      y += Math.round(size * 1.3);
    };
    if (!payload) line("no plan yet", theme.muted);
    else {
      if (payload.message && payload.message_level !== "notice") line(`! ${payload.message}`, COLORS.message);
      if (unusedText) line(`⚠ ${unused.join(", ")} output unused`, theme.warning);
      for (const m of payload.models) {
        const a = answer(m, payload.budget_bytes);
        line(a.short, a.fits ? theme.fits : COLORS.over);
      }
      if (!payload.models.length && payload.message) line(payload.message, theme.muted);
    }
    return { height: Math.ceil(y + 2), regions };
  }

  // Header: what this is and the budget (per model), room for the buttons at the right.
  ctx.font = f(13, 700);
  const head = "VRAM plan";
  const headW = ctx.measureText(head).width;
  text(head, 0, y + 10, theme.strong, f(13, 700));
  if (payload) {
    const s = summarize(payload);
    const budget = payload.budget_bytes != null ? `${gib(payload.budget_bytes)} GiB per model` : "budget: free VRAM less reserve";
    ctx.font = f(12);
    const sub = fitText(ctx, s.models > 1 ? `${budget} · ${s.models} models` : budget, W - headW - 10 - reserveRight);
    text(sub, headW + 8, y + 10, theme.muted, f(12));
    regions.push({ x: 0, y, w: W - reserveRight, h: HEADER_H, tip:
      "Each model connected here gets this budget on its own: they run one after another, not together." });
  }
  y += HEADER_H + 2;

  // A message Python wants seen (budget too small, ...): a tinted box with a round "!" mark,
  // drawn rather than an emoji so it looks the same without emoji fonts.
  const banner = (msg, color, tip = msg) => {
    ctx.font = f(12, 600);
    const lines = wrapText(ctx, msg, W - 34, details ? 8 : 4);
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
    regions.push({ x: 0, y, w: W, h, tip });
    y += h + 6;
  };

  if (unusedText) banner(unusedText, theme.warning);

  if (!payload) {
    ctx.font = f(12);
    for (const l of wrapText(ctx, "Queue the workflow to see whether each model fits and what streaming costs.", W, 3)) {
      text(l, 0, y + 8, theme.muted, f(12));
      y += 16;
    }
    return { height: Math.ceil(y + 2), regions };
  }
  // Red: something went wrong. Grey: a notice (VRAMCut off, or Python says message_level "notice").
  if (payload.message) {
    const notice = !payload.enabled || payload.message_level === "notice";
    const fix = notice ? null : budgetFix(payload);
    banner(fix ? `${fix} ${payload.message}` : payload.message, notice ? COLORS.weightsOnly : COLORS.message,
      fix ? `${fix}\n${payload.message}` : payload.message);
  }
  if (!payload.enabled && !payload.message) banner("VRAMCut is off: the models pass through unchanged.", COLORS.weightsOnly);
  if (!payload.models.length && !payload.message) {
    text("No model connected.", 0, y + 8, theme.muted, f(12));
    y += 18;
  }

  payload.models.forEach((m, idx) => {
    const plan = m.plan;
    const segs = plan.segments;
    const top = y;
    if (idx > 0) {
      rect(0, y, W, 1, theme.border);
      y += 6;
    }
    const a = answer(m, payload.budget_bytes);

    // Title row: label + stage badge.
    const measured = m.stage === "measured";
    const badge = measured ? "measured" : "estimate";
    ctx.font = f(11, 700);
    const bw = ctx.measureText(badge).width + 12;
    if (paint) {
      roundRect(ctx, W - bw, y + 1, bw, 16, 8);
      ctx.fillStyle = measured ? COLORS.measured : COLORS.weightsOnly;
      ctx.fill();
    }
    text(badge, W - bw / 2, y + 9.5, "#fff", f(11, 700), "center");
    ctx.font = f(12, 600);
    text(fitText(ctx, m.label, W - bw - 8), 0, y + 9, theme.strong, f(12, 600));
    regions.push({ x: W - bw, y, w: bw, h: 18, tip: measured
      ? `Measured for input ${m.signature ?? "(this shape)"}: activations and time come from a real run.`
      : "Estimate: weights are exact, activations and time are estimated until the first run." });
    y += 21;

    // The answer line: the verdict coloured, then VRAM, blocks streamed and the time it adds;
    // on two lines when the node is narrow.
    const verdictFont = f(13, 700);
    const restFont = f(13, 500);
    ctx.font = verdictFont;
    const vw = ctx.measureText(a.verdict).width;
    ctx.font = restFont;
    const one = ` · ${a.vram} · ${a.stream} · ${a.time}`;
    const answerTop = y;
    const verdictColor = a.fits ? theme.fits : COLORS.over;
    text(a.verdict, 0, y + 8, verdictColor, verdictFont);
    if (vw + ctx.measureText(one).width <= W) {
      text(one, vw, y + 8, theme.fg, restFont);
      y += 18;
    } else {
      text(fitText(ctx, ` · ${a.vram}`, W - vw), vw, y + 8, theme.fg, restFont);
      y += 17;
      ctx.font = restFont;
      text(fitText(ctx, `${a.stream} · ${a.time}`, W), 0, y + 8, theme.fg, restFont);
      y += 18;
    }
    regions.push({ x: 0, y: answerTop, w: W, h: y - answerTop, tip: costTip(m) });

    // The VRAM bar: the device at the plan's peak, against the budget line.
    const budget = Number(plan.budget_bytes ?? payload.budget_bytes ?? 0);
    const peak = Number(plan.peak_bytes ?? 0);
    const res = Number(plan.resident_bytes ?? 0);
    const win = Number(plan.window_bytes ?? 0);
    const act = plan.activation_reserve_bytes == null ? null : Number(plan.activation_reserve_bytes);
    const scale = Math.max(budget, peak, res + win + (act ?? 0), 1);
    const barH = 14;
    const bx = (b) => (b / scale) * W;
    y += 3;
    if (paint) {
      ctx.save();
      roundRect(ctx, 0, y, Math.max(1, bx(budget)), barH, 3);
      ctx.fillStyle = theme.track;
      ctx.fill();
      ctx.strokeStyle = theme.border;
      ctx.lineWidth = 1;
      ctx.stroke();
      ctx.restore();
    }
    let x = 0;
    for (const [bytes, color] of [[res, COLORS.resident], [win, COLORS.streamed], [act ?? 0, COLORS.activation]]) {
      const w = bx(bytes);
      rect(x, y + 1, w, barH - 2, color);
      x += w;
    }
    if (budget > 0 && peak > budget && paint) {
      ctx.strokeStyle = COLORS.over;
      ctx.lineWidth = 2;
      ctx.strokeRect(bx(budget), y, bx(peak) - bx(budget), barH);
    }
    if (budget > 0) {
      const lx = Math.min(W - 1, Math.max(1, bx(budget)));
      rect(lx - 1, y - 3, 2, barH + 6, theme.strong);
    }
    regions.push({ x: 0, y: y - 3, w: W, h: barH + 6, tip:
      `Peak ${gib(peak)} GiB of ${gib(budget)} GiB: resident ${fmtBytes(res)}, streaming window ${fmtBytes(win)}, ` +
      `activations ${act == null ? "not measured yet" : fmtBytes(act)}. The line is the budget.` });
    y += barH + 5;

    if (!details) {
      if (m.warnings.length) {
        ctx.font = f(12, 600);
        const wt = m.warnings.length === 1 ? `⚠ ${m.warnings[0]}` : `⚠ ${m.warnings.length} warnings: open details`;
        text(fitText(ctx, wt, W), 0, y + 8, theme.warning, f(12, 600));
        regions.push({ x: 0, y, w: W, h: 16, tip: m.warnings.join("\n") });
        y += 17;
      }
      y += 3;
      return;
    }

    // Details: the model in execution order, one bar per segment as wide as its weights, its
    // activations on top on the budget's scale (so 46 MiB looks small next to a 0.3 GiB budget).
    const actH = segs.some((s) => Number(s.activation_bytes) > 0) ? 12 : 0;
    const wH = 20;
    const total = segs.reduce((n, s) => n + Math.max(0, Number(s.weight_bytes) || 0), 0);
    const gap = segs.length && W / segs.length >= 4 ? 1 : 0;
    // widths follow the bytes; tiny segments still get a sliver (at most 15% of the width in
    // all goes to these minimums, so the proportions stay true)
    const minW = Math.min(2, (0.15 * W) / Math.max(1, segs.length));
    const free = Math.max(0, W - minW * segs.length);
    const names = segs.map((s) => shortSegmentName(s.name));
    const prefix = sharedPrefix(names);
    let sx = 0;
    y += 2;
    segs.forEach((s, i) => {
      const wb = Math.max(0, Number(s.weight_bytes) || 0);
      const sw = minW + (total > 0 ? (wb / total) * free : free / segs.length);
      const color = s.resident ? COLORS.resident : s.idle ? COLORS.idle : COLORS.streamed;
      const drawW = sw - (sw > 2 ? gap : 0);
      rect(sx, y + actH, drawW, wH, color);
      const av = Number(s.activation_bytes) || 0;
      if (actH && av > 0) {
        const h = Math.min(actH - 1, Math.max(1, (av / Math.max(budget, av, 1)) * (actH - 1)));
        rect(sx, y + actH - 1 - h, drawW, h, COLORS.activation);
      }
      if (paint && drawW > 26) {
        ctx.font = f(11, 600);
        const label = names[i].slice(prefix.length);
        const fitted = fitText(ctx, label, drawW - 6);
        if (fitted && fitted !== "…") text(fitted, sx + 3, y + actH + wH / 2, "#fff", f(11, 600));
      }
      const nUnits = asArray(s.units).length;
      const where = s.resident ? "resident" : s.idle ? "idle (not run)" : "streamed each step";
      regions.push({ x: sx, y, w: sw, h: actH + wH, tip:
        `${names[i]} · ${where}\n${fmtBytes(wb)} weights · ${s.activation_bytes == null ? "activations not measured" : `${fmtBytes(av)} activations`}` +
        (nUnits > 1 ? ` · ${nUnits} blocks` : "") });
      sx += sw;
    });
    if (!segs.length) text("no segments", 0, y + actH + wH / 2, theme.muted, f(12));
    y += actH + wH + 4;

    // Counts, the shared prefix dropped from the labels, and the input signature.
    const nRes = segs.filter((s) => s.resident).length;
    const nStr = segs.filter(isStreamed).length;
    const nIdle = segs.filter(isIdle).length;
    const nCopies = Number(plan.transfers_per_forward);
    let counts = `${prefix ? `${prefix}* · ` : ""}${nRes} resident · ${nStr} streamed` + (nIdle ? ` · ${nIdle} idle` : "") +
      ` segments` + (Number.isFinite(nCopies) && nCopies > 0 ? ` · ${nCopies} transfer${nCopies === 1 ? "" : "s"} per forward` : "");
    if (m.signature) counts += ` · ${m.signature}`;
    ctx.font = f(12);
    text(fitText(ctx, counts, W), 0, y + 8, theme.muted, f(12));
    y += 17;

    ctx.font = f(12, 600);
    for (const w of m.warnings) {
      const lines = wrapText(ctx, `⚠ ${w}`, W, 3);
      const h0 = y;
      for (const l of lines) {
        text(l, 0, y + 8, theme.warning, f(12, 600));
        y += 15;
      }
      regions.push({ x: 0, y: h0, w: W, h: y - h0, tip: w });
    }
    regions.push({ x: 0, y: top, w: W, h: y - top, tip: m.label, section: true });
    y += 4;
  });

  // Legend, with the details.
  if (details && payload.models.length) {
    let lx = 0;
    const items = [["resident", COLORS.resident], ["streamed", COLORS.streamed], ["activations", COLORS.activation]];
    if (summarize(payload).idle) items.push(["idle", COLORS.idle]);
    ctx.font = f(12);
    for (const [name, color] of items) {
      rect(lx, y + 2, 10, 10, color);
      text(name, lx + 13, y + 7, theme.muted, f(12));
      lx += 13 + ctx.measureText(name).width + 10;
    }
    rect(lx + 3, y, 2, 14, theme.strong);
    text("budget", lx + 9, y + 7, theme.muted, f(12));
    y += 17;
  }
  return { height: Math.ceil(y + 2), regions };
}

// ---------------------------------------------------------------------------------- tooltips

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
window.addEventListener("pointermove", hover, { passive: true });

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
new MutationObserver(onThemeMaybeChanged).observe(document.documentElement, { attributes: true, attributeFilter: ["class", "style"] });
new MutationObserver(onThemeMaybeChanged).observe(document.head, { childList: true, subtree: true, characterData: true });
window.addEventListener("pointerdown", () => tipOwner && showTip(null), { passive: true, capture: true });

// ---------------------------------------------------------------------------------- the widget

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

class PlanView {
  constructor(node) {
    this.node = node;
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

    const canvas = document.createElement("canvas");
    canvas.className = "vramcut-plan-canvas";
    Object.assign(canvas.style, { display: "block", width: "100%", height: "100%" });

    const pre = document.createElement("pre");
    pre.className = "vramcut-plan-table";
    Object.assign(pre.style, {
      display: "none", position: "absolute", left: "0", right: "0", top: `${HEADER_H}px`, bottom: "0",
      margin: "0", padding: "4px", overflow: "auto", whiteSpace: "pre", pointerEvents: "auto",
      font: "11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)",
      border: "1px solid var(--border-color, #4e4e4e)", borderRadius: "4px", boxSizing: "border-box",
    });
    // the table scrolls on its own; the graph zooms everywhere else
    pre.addEventListener("wheel", (e) => e.stopPropagation(), { passive: true });

    const bar = document.createElement("div");
    Object.assign(bar.style, { position: "absolute", right: "0", top: "0", display: "flex", gap: "4px" });
    this.detailsButton = makeButton("details", "Show every segment, the legend and all warnings",
      () => this.node.vramcutSetDetails?.(!this.details));
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
      const target = app.canvas?.canvas;
      if (!target || e.target.closest?.("button, pre")) return;
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
    this.updateDataset();
  }

  setPayload(payload) {
    this.raw = payload ?? null;
    this.payload = normalizePayload(payload);
    this.pre.textContent = allText(this.payload);
    this.updateDataset();
    this.scheduleDraw();
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
    const fix = this.payload?.message && this.payload.message_level !== "notice" ? budgetFix(this.payload) : null;
    if (fix) d.fix = fix;
    else delete d.fix;
    d.warnings = String((this.payload?.models ?? []).reduce((n, m) => n + m.warnings.length, 0));
    d.answers = (this.payload?.models ?? []).map((m) => answer(m, this.payload.budget_bytes).line).join("\n");
    d.unused = this.unused.join(",");
  }

  toggleTable(show = !this.showTable) {
    this.showTable = show;
    this.pre.style.display = show ? "block" : "none";
    this.button.textContent = show ? "chart" : "table";
    this.button.title = show ? "Show the plan as a chart" : "Show the plan as a text table";
    this.el.dataset.view = show ? "table" : "chart";
    this.scheduleDraw();
  }

  zoom() {
    return app.canvas?.ds?.scale ?? 1;
  }

  renderOptions() {
    return { reserveRight: (this.bar.offsetWidth || 110) + 6, details: this.details, zoom: this.zoom(), unused: this.unused };
  }

  /** Content height at a css width (at zoom 1), measured by the same pass that paints. */
  contentHeight(width) {
    const W = Math.max(120, Math.round(width));
    const theme = readTheme(this.el);
    const key = `${W}|${theme.font}|${this.details}|${this.unused.join(",")}`;
    if (this.heightCache?.payload !== this.payload || this.heightCache.key !== key) {
      const opts = { ...this.renderOptions(), zoom: 1 };
      this.heightCache = { payload: this.payload, key, height: render(this.ctx, this.payload, W, theme, false, opts).height };
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

  /** The canvas is CSS-scaled with the graph: draw at devicePixelRatio x zoom, so that one
   * canvas pixel is one screen pixel and text stays sharp when zoomed in or out. */
  pixelScale() {
    return (window.devicePixelRatio || 1) * Math.min(4, Math.max(0.25, this.zoom()));
  }

  draw() {
    const cssW = this.el.clientWidth;
    const cssH = this.el.clientHeight;
    if (!cssW || !cssH) return; // not mounted (collapsed, hidden, off-screen): drawn on next resize
    if (this.fitPending) {
      const how = this.fitPending;
      this.fitPending = null;
      this.node.vramcutFit?.({ ...how, tries: 1 });
    }
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
    this.el.dataset.drawn = String(Number(this.el.dataset.drawn || 0) + 1);
    this.el.dataset.contentHeight = String(out.height);
  }

  /** Called from the widget's onDraw (every LiteGraph frame): redraw when the zoom crossed a
   * threshold or the pixel scale changed, and (a few times a second) when the palette changed. */
  checkFrame() {
    if (Math.abs(this.pixelScale() - this.drawnScale) > 0.01 || (this.zoom() < LOW_ZOOM) !== this.drawnLow) this.scheduleDraw();
    const now = performance.now();
    if (now - this.themeCheckedAt > 250) {
      this.themeCheckedAt = now;
      this.checkTheme();
      this.node.vramcutCheckLinks?.();
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
    const lg = app.canvas;
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
      app.extensionManager?.workflow?.activeWorkflow?.changeTracker?.checkState?.();
    };
    el.addEventListener("pointermove", move, true);
    el.addEventListener("pointerup", up, true);
    el.addEventListener("pointercancel", up, true);
  }

  destroy() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    this.resizeObserver?.disconnect();
    this.resizeObserver = null;
    views.delete(this);
    if (tipOwner === this) showTip(null);
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

function graphId() {
  const g = app.rootGraph ?? app.graph;
  return g?.id ? String(g.id) : null;
}

// Plans seen in this page, by workflow and node: a workflow loaded again (tab switch, undo)
// shows its plan without asking the server.
const seen = new Map();
const seenKey = (node) => `${graphId() ?? ""}:${node.id}`;

// After a page reload the plans come from the server's history: the newest output of a node
// with this id and type, from this workflow when the history says which.
let historyRequest = null;
let historyAt = 0;

function recentHistory() {
  if (!historyRequest || performance.now() - historyAt > 3000) {
    historyAt = performance.now();
    historyRequest = api.fetchApi(`/history?max_items=${HISTORY_ITEMS}`)
      .then((r) => (r.ok ? r.json() : {}))
      .catch(() => ({}));
  }
  return historyRequest;
}

async function planFromHistory(node) {
  const history = await recentHistory();
  const id = String(node.id);
  const gid = graphId();
  let found = null;
  for (const entry of Object.values(history ?? {})) {
    const out = entry?.outputs?.[id]?.vramcut;
    if (!out) continue;
    const prompt = Array.isArray(entry.prompt) ? entry.prompt : [];
    if (prompt[2]?.[id]?.class_type !== node.type) continue;
    // only this workflow's own runs (a prompt sent through the API names no workflow)
    const wf = prompt[3]?.extra_pnginfo?.workflow?.id;
    if (!wf || !gid || String(wf) !== gid) continue;
    found = lastPayload(out) ?? found; // the history lists the newest last
  }
  return found;
}

/** Names of the outputs whose matching input is connected while they themselves lead nowhere. */
function unusedOutputs(node) {
  const out = [];
  for (const input of node.inputs ?? []) {
    if (input.link === null || input.link === undefined) continue;
    const o = (node.outputs ?? []).find((x) => x.name === input.name) ??
      (node.outputs ?? []).find((x) => x.type === input.type);
    if (o && !(o.links && o.links.length)) out.push(String(o.type ?? o.name).toUpperCase());
  }
  return out;
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
      let wantContent = false;

      const widget = node.addDOMWidget(WIDGET_NAME, "vramcut_plan", view.el, {
        serialize: false,
        hideOnZoom: false, // zoomed out the plan still answers (LiteGraph draws no text there)
        margin: MARGIN,
        getValue: () => "",
        setValue: () => {},
        // No locked minimum: the node can be made as small as the header. Only while this code
        // fits the node does the minimum become the content's height.
        getMinHeight: () => (wantContent
          ? view.contentHeight((node.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN)
          : MIN_WIDGET_HEIGHT),
        onDraw: () => view.checkFrame(),
      });
      widget.serialize = false; // keep widgets_values to the real inputs
      node.vramcutWidget = widget;

      // Grow the node to show the plan; shrink only on the user's own request (`shrink`). A plan
      // that fits changes nothing, so a run with no edit leaves a saved workflow unchanged.
      // Mounted, the widget's own height says how much the node must change; before that (or
      // while the host has not laid out the last change yet) the node's computed size does.
      let lastFit = null;
      node.vramcutFit = ({ shrink = false, tries = 0 } = {}) => {
        if (node.flags?.collapsed) return;
        const w = Math.max(node.size[0], MIN_NODE_WIDTH);
        const area = view.el.clientHeight;
        if (area > 0 && lastFit && lastFit.h === node.size[1] && lastFit.area === area) {
          // the host has not laid out the last size yet: look again in a frame
          if (tries < 10) {
            requestAnimationFrame(() => node.vramcutFit({ shrink, tries: tries + 1 }));
            return;
          }
        }
        lastFit = null;
        if (area === 0 && tries === 0) {
          view.fitPending = { shrink }; // not laid out yet: fitted on its first draw
          return;
        }
        let h;
        if (area > 0) {
          const need = view.contentHeight(view.el.clientWidth || w - 2 * MARGIN) - area;
          h = node.size[1] + (shrink ? need : Math.max(0, need));
        } else {
          wantContent = true;
          try {
            const min = node.computeSize();
            h = shrink ? min[1] : Math.max(node.size[1], min[1]);
          } finally {
            wantContent = false;
          }
        }
        if (Math.abs(w - node.size[0]) > 0.5 || Math.abs(h - node.size[1]) > 0.5) {
          node.setSize([w, h]);
          lastFit = { h: node.size[1], area };
        }
        node.setDirtyCanvas?.(true, true);
      };

      node.vramcutSetDetails = (on) => {
        view.setDetails(on);
        // a user's choice, kept with the workflow like any other edit
        node.properties = node.properties || {};
        if (on) node.properties[VIEW_PROPERTY] = "details";
        else delete node.properties[VIEW_PROPERTY];
        node.vramcutFit({ shrink: true });
      };

      node.vramcutCheckLinks = () => {
        if (view.setUnused(unusedOutputs(node))) node.vramcutFit();
      };

      node.vramcutOnEvent = (e) => {
        const detail = e?.detail;
        if (!detail || !eventIsFor(node, detail.node) || !isCurrentPrompt(detail)) return;
        node.vramcutShow(detail.payload);
      };
      api.addEventListener(EVENT, node.vramcutOnEvent);

      if (node.size[0] < MIN_NODE_WIDTH) node.setSize([MIN_NODE_WIDTH, node.size[1]]);
      requestAnimationFrame(() => node.vramcutFit?.());
      return r;
    };

    proto.vramcutShow = function (payload, { fit = true } = {}) {
      const view = this.vramcutView;
      if (!view) return;
      view.setPayload(payload);
      if (payload) seen.set(seenKey(this), payload);
      // Grow only when the content's height changed since it was last fitted: a node the user
      // made smaller keeps its size through every run that draws the same kind of plan.
      // A plan shown again after a load leaves the saved size alone (and counts as not fitted).
      if (fit) {
        const h = view.contentHeight((this.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN);
        const changed = h !== view.fittedHeight;
        view.fittedHeight = h;
        if (changed) this.vramcutFit?.();
      }
      this.setDirtyCanvas?.(true, false);
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
      const view = this.vramcutView;
      if (!view) return r;
      view.setDetails(this.properties?.[VIEW_PROPERTY] === "details");
      // A loaded workflow keeps its saved size: showing its plan again must not change it.
      const known = seen.get(seenKey(this)) ?? this.properties?.[LEGACY_PROPERTY];
      if (known) this.vramcutShow(known, { fit: false });
      else {
        planFromHistory(this).then((p) => {
          if (p && !view.payload && this.vramcutView === view) this.vramcutShow(p, { fit: false });
        });
      }
      return r;
    };

    const onConnectionsChange = proto.onConnectionsChange;
    proto.onConnectionsChange = function () {
      const r = onConnectionsChange?.apply(this, arguments);
      this.vramcutCheckLinks?.();
      return r;
    };

    // Collapsed, the node's title carries the answer.
    const getTitle = proto.getTitle;
    proto.getTitle = function () {
      const title = getTitle ? getTitle.apply(this, arguments) : this.title;
      const p = this.flags?.collapsed ? this.vramcutView?.payload : null;
      if (!p?.models?.length) return title;
      const more = p.models.length > 1 ? ` +${p.models.length - 1}` : "";
      return `${title} · ${answer(p.models[0], p.budget_bytes).short}${more}`;
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
