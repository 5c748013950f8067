// The canvas drawing: lays out and paints one node's plan, at any width, zoom and palette.
//
// `render` is one pass that both measures and paints (a pen with paint off only measures), so the
// height the node grows to always matches what is drawn. The named draw functions below each
// draw one part (header, banner, messages, the legend; one model in model.js) and leave the pen
// below it; each adds the hover regions for its tooltips.
// Rule: draw Python's figures, never recompute the plan; touch no DOM but the canvas context,
// and do nothing at import (ComfyUI also loads this file on its own as an extension script).

import { summarize } from "./payload.js";
import { answer, gib, refusal, refusalFor } from "./format.js";
import { COLORS, inkOn } from "./theme.js";
import { fitText, makePen, roundRect, wrapText } from "./pen.js";
import { drawModel } from "./model.js";

export const LOW_ZOOM = 0.6;  // LiteGraph draws no text below this scale: the plan keeps its answer
const READABLE_PX = 11;       // on-screen text size the low-zoom view aims for
export const HEADER_H = 22;   // the header row (the buttons sit in it)
const BANNER_LINES = 24;      // a message is shown whole (this only bounds a runaway one)

/**
 * Lays out and (when `paint`) draws the payload at css width W. Returns the height used and
 * hover regions [{x, y, w, h, tip}]. The same pass measures and paints, so the height the node
 * grows to always matches what is drawn. opts: {reserveRight, details, zoom, unused}.
 */
export function render(ctx, payload, W, theme, paint, opts = {}) {
  const { reserveRight = 0, details = false, zoom = 1, unused = [], devicesLinked = false } = opts;
  let headerH = 0;
  const pen = makePen(ctx, W, theme, paint);
  const unusedText = unused.length
    ? `${unused.join(", ")} output${unused.length > 1 ? "s are" : " is"} not connected: the plan never applies. ` +
      "Take the model from this node's output."
    : null;

  // Zoomed out, LiteGraph draws no text: keep the answer, one big line per model.
  if (zoom < LOW_ZOOM) drawZoomedOut(pen, payload, zoom, unused);
  else {
    drawHeader(pen, payload, reserveRight);
    headerH = pen.y;
    if (devicesLinked) drawDevicesNote(pen);
    if (!payload) {
      if (unusedText) drawBanner(pen, unusedText, theme.warning, details);
      drawNoPlan(pen);
    } else {
      drawMessages(pen, payload, details);
      // below an error: the error is what stopped the run
      if (unusedText && payload.enabled) drawBanner(pen, unusedText, theme.warning, details);
      payload.models.forEach((m, idx) => drawModel(pen, m, idx, payload.budget_bytes, details, refusalFor(payload, m)));
      // the key to the colours, in both views (a refusal draws its own bar, no plan's)
      if (payload.models.some((m) => !refusalFor(payload, m))) drawLegend(pen, payload, details);
    }
  }
  return { height: Math.ceil(pen.y + 2), regions: pen.regions, texts: pen.texts, bars: pen.bars, headerH };
}

/** One big line per model (its short answer), sized to stay readable on screen. */
function drawZoomedOut(pen, payload, zoom, unused) {
  const { ctx, W, theme } = pen;
  const size = Math.min(40, Math.max(13, READABLE_PX / Math.max(zoom, 0.05)));
  const line = (s, color) => {
    ctx.font = pen.font(size, 700);
    pen.text(fitText(ctx, s, W), 0, pen.y + size * 0.65, color, pen.font(size, 700));
    pen.y += Math.round(size * 1.3);
  };
  if (!payload) line("no plan yet", theme.muted);
  else {
    if (payload.message && payload.message_level !== "notice") line(`! ${refusal(payload)?.fix ?? payload.message}`, COLORS.message);
    if (unused.length) line(`⚠ ${unused.join(", ")} output unused`, theme.warning);
    for (const m of payload.models) {
      const a = answer(m, payload.budget_bytes, refusalFor(payload, m));
      line(a.short, a.fits ? theme.fits : COLORS.over);
    }
    if (!payload.models.length && payload.message) line(payload.message, theme.muted);
  }
}

/** The budget as the header says it: per model, "off" when VRAMCut is off (a budget of 0). */
export function budgetText(payload) {
  if (!payload.enabled || Number(payload.budget_bytes) === 0) return "budget off";
  if (payload.devices?.length)
    return payload.devices.map((d) => `${d.device} ${d.budget_bytes == null ? "free" : `${gib(d.budget_bytes)} GiB`}`).join(" · ");
  if (payload.budget_bytes == null) return "budget: free VRAM less reserve";
  return `${gib(payload.budget_bytes)} GiB per model`;
}

/** What this is and the budget (per model), room for the buttons at the right. Where the row
 * beside the buttons is too narrow, the title (and then the budget) go on rows of their own
 * below the buttons: nothing is drawn under them. */
function drawHeader(pen, payload, reserveRight) {
  const { ctx, W, theme } = pen;
  ctx.font = pen.font(13, 700);
  const head = "VRAM plan";
  const headW = ctx.measureText(head).width;
  const besideButtons = W - reserveRight - 4;
  const top = pen.y;
  if (headW > besideButtons) pen.y += HEADER_H; // the buttons keep the first row to themselves
  const rowY = pen.y;
  pen.text(head, 0, rowY + 10, theme.strong, pen.font(13, 700), "left", null, "title");
  let room = (pen.y === top ? besideButtons : W) - headW - 8;
  if (payload) {
    const s = summarize(payload);
    const budget = budgetText(payload);
    const sub = s.models > 1 ? `${budget} · ${s.models} models` : budget;
    ctx.font = pen.font(12);
    let x = headW + 8;
    let y = rowY;
    if (ctx.measureText(sub).width > room) {
      // a row of its own, below
      pen.y += HEADER_H - 4;
      y = pen.y;
      x = 0;
      room = W; // below the buttons' row
    }
    pen.text(fitText(ctx, sub, room), x, y + 10, theme.muted, pen.font(12), "left", null, "budget");
    pen.tip(0, top, W, pen.y + HEADER_H - top, payload.devices?.length
      ? "Each model connected here may use these devices, each within its budget (free: its free VRAM less the reserve); " +
        "the models run one after another, not together."
      : "Each model connected here gets this budget on its own: they run one after another, not together.");
  }
  pen.y += HEADER_H + 2;
}

/** A message Python wants seen (budget too small, ...): a tinted box with a round "!" mark,
 * drawn rather than an emoji so it looks the same without emoji fonts. */
function drawBanner(pen, msg, color, details, tip = msg, headline = null) {
  const { ctx, W, theme } = pen;
  const y = pen.y;
  ctx.font = pen.font(13, 700);
  const head = headline ? wrapText(ctx, headline, W - 34, 2) : [];
  ctx.font = pen.font(12, headline ? 500 : 600);
  const lines = wrapText(ctx, msg, W - 34, BANNER_LINES); // whole: the node grows to hold it
  const h = Math.max(26, head.length * 16 + lines.length * 15 + 10);
  if (pen.paint) {
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
  pen.text("!", 14, y + 13.5, inkOn(color), pen.font(12, 800), "center", color);
  head.forEach((l, i) => pen.text(l, 28, y + 5 + 8 + i * 16, theme.strong, pen.font(13, 700), "left", null, "banner"));
  const top = y + 5 + head.length * 16;
  lines.forEach((l, i) => pen.text(l, 28, top + 7.5 + i * 15, headline ? theme.fg : theme.strong, pen.font(12, headline ? 500 : 600),
    "left", null, "banner"));
  pen.tip(0, y, W, h, tip);
  pen.y += h + 6;
}

/** A Devices node feeds this node: its budgets apply, not the two widgets above the plan. */
function drawDevicesNote(pen) {
  const top = pen.y;
  pen.ctx.font = pen.font(12);
  const note = "Devices connected: its budgets apply; max_vram_gb only turns VRAMCut off (0), budget_mode is not used.";
  for (const l of wrapText(pen.ctx, note, pen.W, 4)) {
    pen.text(l, 0, pen.y + 8, pen.theme.muted, pen.font(12), "left", null, "devices-note");
    pen.y += 16;
  }
  pen.tip(0, top, pen.W, pen.y - top, "The Devices node gives each device its own budget; they replace this node's " +
    "max_vram_gb (0 still turns VRAMCut off) and budget_mode.");
  pen.y += 4;
}

function drawNoPlan(pen) {
  pen.ctx.font = pen.font(12);
  for (const l of wrapText(pen.ctx, "Queue the workflow to see whether each model fits and what streaming costs.", pen.W, 3)) {
    pen.text(l, 0, pen.y + 8, pen.theme.muted, pen.font(12));
    pen.y += 16;
  }
}

/** Red: something went wrong. Grey: a notice (VRAMCut off, or Python says message_level "notice"). */
function drawMessages(pen, payload, details) {
  if (payload.message) {
    const notice = !payload.enabled || payload.message_level === "notice";
    const fix = notice ? null : refusal(payload)?.fix;
    // a refusal leads with its fix, one number; the reason follows
    drawBanner(pen, payload.message, notice ? COLORS.weightsOnly : COLORS.message,
      details, fix ? `${fix}\n${payload.message}` : payload.message, fix);
  }
  if (!payload.enabled && !payload.message) {
    drawBanner(pen, "VRAMCut is off: the models pass through unchanged.", COLORS.weightsOnly, details);
  }
  if (!payload.models.length && !payload.message) {
    pen.text("No model connected.", 0, pen.y + 8, pen.theme.muted, pen.font(12));
    pen.y += 18;
  }
}

/** The key to the colours: what the bars show (in the compact view the parts of the VRAM bar
 * this plan has, with the details every kind of segment); items flow onto more rows when narrow. */
function drawLegend(pen, payload, details) {
  const { ctx, theme, W } = pen;
  const plans = payload.models.map((m) => m.plan);
  const has = (f) => plans.some((p) => Number(f(p)) > 0);
  const items = [];
  if (details || has((p) => p.resident_bytes)) items.push(["resident", COLORS.resident]);
  if (details || has((p) => p.window_bytes)) items.push(["streamed", COLORS.streamed]);
  if (has((p) => p.activation_reserve_bytes)) items.push(["activations", COLORS.activation]);
  if (details && summarize(payload).idle) items.push(["idle", COLORS.idle]);
  // under max_ram_gb, the RAM bar's parts
  const tiers = payload.models.map((m) => m.tiers).filter(Boolean);
  if (tiers.length) items.push(["RAM", COLORS.ram]);
  if (tiers.some((t) => Number(t.bounce_bytes) > 0)) items.push(["bounce", COLORS.bounce]);
  if (tiers.some((t) => Number(t.disk_bytes) > Number(t.resident_disk_bytes ?? 0))) items.push(["disk", COLORS.disk]);
  items.push(["budget", null]);
  const font = pen.font(11);
  ctx.font = font;
  let lx = 0;
  const row = 15;
  for (const [name, color] of items) {
    const w = 13 + ctx.measureText(name).width;
    if (lx > 0 && lx + w > W) {
      pen.y += row;
      lx = 0;
    }
    if (color) pen.rect(lx, pen.y + 2, 10, 10, color);
    else pen.rect(lx + 4, pen.y, 2, 14, theme.strong);
    pen.text(name, lx + 13, pen.y + 7, theme.muted, font, "left", null, "legend");
    lx += w + 10;
  }
  pen.y += row + 2;
}
