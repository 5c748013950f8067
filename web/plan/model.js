// One model's part of the plan: its title and stage badge, the answer line, the time and re-plan
// lines, the VRAM bar (one per device when placed across several), under max_ram_gb the RAM
// row and bar (ram.js), and with the details every
// segment, the counts and every warning. Each draw function leaves the pen below what it drew
// and adds the hover regions for its tooltips.
// Rule: draw Python's figures, never recompute the plan; touch no DOM but the canvas context,
// and do nothing at import (ComfyUI also loads this file on its own as an extension script).

import { answer, blockCount, copies, costTip, deviceRow, fmtBytes, gib, gibText, hopTexts, refitLine,
  segmentContents, segmentCounts, sharedPrefix, shortSegmentName, timeLine } from "./format.js";
import { COLORS, inkOn } from "./theme.js";
import { groupLabels, labelChoices, pickLabels } from "./labels.js";
import { fitText, paintTrack, roundRect, wrapText } from "./pen.js";
import { drawRam } from "./ram.js";

const ACT_H = 22;             // the activation row above the segment bars (the tallest is this high)
const ACT_MIN_H = 4;          // an activation, however small, stays visible
const WARNING_LINES = 6;      // a warning is shown whole (this only bounds a runaway one)

/** One model: title, answer line, VRAM bar, then one warning line, or with the details every
 * segment, the counts and every warning. */
export function drawModel(pen, m, idx, payloadBudget, details, refused = null) {
  const top = pen.y;
  if (idx > 0) {
    pen.rect(0, pen.y, pen.W, 1, pen.theme.border);
    pen.y += 6;
  }
  drawTitle(pen, m, refused);
  drawAnswer(pen, m, answer(m, payloadBudget, refused));
  const budget = Number(m.plan.budget_bytes ?? payloadBudget ?? 0);
  if (refused) {
    // the plan drawn before the run does not answer any more: the budget the error asks for does
    drawNeedBar(pen, refused.need, budget);
    pen.y += 3;
    return;
  }
  const t = timeLine(m);
  if (t) drawLine(pen, t.text, t.measured ? pen.theme.fg : pen.theme.muted, "time", t.tip);
  const r = refitLine(m);
  if (r) drawLine(pen, r.text, pen.theme.warning, "refit", r.tip);
  if (m.plan.devices.length) drawDevices(pen, m.plan);
  else drawBar(pen, m.plan, budget);
  if (m.tiers) drawRam(pen, m, details); // under max_ram_gb: RAM beside VRAM
  if (!details) {
    drawWarningLine(pen, m.warnings);
    pen.y += 3;
    return;
  }
  const prefix = drawSegments(pen, m.plan, budget);
  drawCounts(pen, m, prefix);
  drawWarnings(pen, m.warnings);
  pen.regions.push({ x: 0, y: top, w: pen.W, h: pen.y - top, tip: m.label, section: true });
  pen.y += 4;
}

/** Title row: the model's label and its stage badge. */
function drawTitle(pen, m, refused = null) {
  const { ctx, W, theme, y } = pen;
  const measured = m.stage === "measured";
  const traced = m.stage === "traced";
  const badge = refused ? "refused" : measured ? "measured" : traced ? "traced" : "estimate";
  ctx.font = pen.font(11, 700);
  const bw = ctx.measureText(badge).width + 12;
  const fill = refused ? COLORS.over : measured ? COLORS.measured : traced ? COLORS.traced : COLORS.weightsOnly;
  if (pen.paint) {
    roundRect(ctx, W - bw, y + 1, bw, 16, 8);
    ctx.fillStyle = fill;
    ctx.fill();
  }
  pen.text(badge, W - bw / 2, y + 9.5, inkOn(fill), pen.font(11, 700), "center", fill, "badge");
  ctx.font = pen.font(12, 600);
  // the label wraps beside the badge (a narrow node), whole up to three rows
  const rows = wrapText(ctx, m.label, W - bw - 8, 3);
  rows.forEach((l, i) => pen.text(l, 0, y + 9 + i * 15, theme.strong, pen.font(12, 600), "left", null, "label"));
  pen.tip(W - bw, y, bw, 18, refused ? "The run was refused: this budget cannot hold it. The banner says which budget works."
    : measured ? `Measured for ${m.inputs ?? "this input"}: activations and time come from a real call.`
    : traced ? `Traced at ${m.traced_at}: activations from a dry run on fake tensors; no weight moved. The first real run measures them.`
    : "Estimate: weights are exact, activations and time are estimated until the first run.");
  pen.y += 21 + (rows.length - 1) * 15;
}

/** The answer line: the verdict coloured, then VRAM, blocks streamed and the time it adds;
 * on two lines when the node is narrow. */
function drawAnswer(pen, m, a) {
  const { ctx, W, theme } = pen;
  const verdictFont = pen.font(13, 700);
  const restFont = pen.font(13, 500);
  const answerTop = pen.y;
  // the parts flow onto as many rows as the width needs, each part whole
  const parts = [[a.verdict, a.fits ? theme.fits : COLORS.over, verdictFont],
    ...[a.vram, a.stream, a.hops, a.disk, a.time].filter(Boolean).map((t) => [t, theme.fg, restFont])];
  let x = 0;
  const place = (s, color, font) => {
    pen.text(s, x, pen.y + 8, color, font, "left", null, "answer");
    x += ctx.measureText(s).width;
  };
  const newRow = () => {
    pen.y += 17;
    x = 0;
  };
  parts.forEach(([t, color, font], i) => {
    ctx.font = font;
    const sep = i && x > 0 ? " · " : "";
    if (x > 0 && x + ctx.measureText(sep + t).width > W) newRow();
    if (ctx.measureText(t).width <= W - x) place(x > 0 ? sep + t : t, color, font);
    else {
      // a part wider than the node: its words flow over rows, each whole
      t.split(" ").forEach((word, k) => {
        const gap = k ? " " : x > 0 ? sep : "";
        if (x > 0 && x + ctx.measureText(gap + word).width > W) newRow();
        place(x > 0 ? gap + word : fitText(ctx, word, W), color, font);
      });
    }
  });
  pen.y += 18;
  pen.tip(0, answerTop, W, pen.y - answerTop, a.refused
    ? `Refused: ${m.kind} alone needs ${a.need ? `${gibText(a.need)} GiB` : "more"}; the banner's budget holds every connected model (each gets the whole budget in turn).`
    : costTip(m));
}

/** A line of its own under the answer (the time line, a re-plan), wrapped whole. */
function drawLine(pen, text, color, kind, tip) {
  const top = pen.y;
  pen.ctx.font = pen.font(12, 500);
  for (const l of wrapText(pen.ctx, text, pen.W, 3)) {
    pen.text(l, 0, pen.y + 8, color, pen.font(12, 500), "left", null, kind);
    pen.y += 16;
  }
  pen.tip(0, top, pen.W, pen.y - top, tip);
  pen.y += 1;
}

/** One row per device: its name and peak against its budget, then its bar (resident, streaming
 * window, activations) against its own budget line; then the hops between them. */
function drawDevices(pen, plan) {
  const { ctx, W, theme } = pen;
  for (const d of plan.devices) {
    const row = deviceRow(d);
    const top = pen.y;
    ctx.font = pen.font(12, 600);
    for (const l of wrapText(ctx, row.text, W, 3)) {
      pen.text(l, 0, pen.y + 8, row.fits ? theme.strong : COLORS.over, pen.font(12, 600), "left", null, "device");
      pen.y += 15;
    }
    drawBar(pen, {
      peak_bytes: d.peak_bytes, resident_bytes: d.resident_bytes, window_bytes: d.window_bytes,
      activation_reserve_bytes: d.activation_bytes,
    }, Number(d.budget_bytes ?? 0), row.tip);
    pen.tip(0, top, W, pen.y - top, row.tip);
  }
  const hops = hopTexts(plan);
  if (hops.length) {
    const top = pen.y;
    ctx.font = pen.font(12);
    for (const l of wrapText(ctx, `${hops.length === 1 ? "hop" : "hops"}: ${hops.join("; ")}`, W, 4)) {
      pen.text(l, 0, pen.y + 8, theme.muted, pen.font(12), "left", null, "hops");
      pen.y += 16;
    }
    pen.tip(0, top, W, pen.y - top, "Between devices only the activations crossing the cut move (device to device, " +
      "never through the host), once per call at each hop.");
    pen.y += 1;
  }
}

/** After a refusal: the budget the error asks for against the one set (red past the line). */
function drawNeedBar(pen, need, budget) {
  const { W, theme } = pen;
  const barH = 14;
  const scale = Math.max(budget, need ?? 0, 1);
  const bx = (b) => (b / scale) * W;
  pen.y += 3;
  const y = pen.y;
  pen.rect(0, y, Math.max(1, bx(budget)), barH, theme.track);
  if (need) pen.rect(0, y + 1, bx(need), barH - 2, COLORS.over);
  if (budget > 0) pen.rect(Math.min(W - 1, Math.max(1, bx(budget))) - 1, y - 3, 2, barH + 6, theme.strong);
  pen.tip(0, y - 3, W, barH + 6, need
    ? `This run needs ${gibText(need)} GiB; the budget (the line) is ${gib(budget)} GiB.`
    : `The budget (the line) is ${gib(budget)} GiB.`);
  pen.y += barH + 5;
}

/** The VRAM bar: the device at the plan's peak, against the budget line. */
function drawBar(pen, plan, budget, tip = null) {
  const { ctx, W, theme } = pen;
  const peak = Number(plan.peak_bytes ?? 0);
  const res = Number(plan.resident_bytes ?? 0);
  const win = Number(plan.window_bytes ?? 0);
  const act = plan.activation_reserve_bytes == null ? null : Number(plan.activation_reserve_bytes);
  const scale = Math.max(budget, peak, res + win + (act ?? 0), 1);
  const barH = 14;
  const bx = (b) => (b / scale) * W;
  pen.y += 3;
  const y = pen.y;
  paintTrack(pen, y, bx(budget), barH);
  let x = 0;
  for (const [bytes, color] of [[res, COLORS.resident], [win, COLORS.streamed], [act ?? 0, COLORS.activation]]) {
    const w = bx(bytes);
    pen.rect(x, y + 1, w, barH - 2, color);
    x += w;
  }
  if (budget > 0 && peak > budget && pen.paint) {
    ctx.strokeStyle = COLORS.over;
    ctx.lineWidth = 2;
    ctx.strokeRect(bx(budget), y, bx(peak) - bx(budget), barH);
  }
  if (budget > 0) {
    const lx = Math.min(W - 1, Math.max(1, bx(budget)));
    pen.rect(lx - 1, y - 3, 2, barH + 6, theme.strong);
  }
  pen.tip(0, y - 3, W, barH + 6, tip ??
    `Peak ${gib(peak)} GiB of ${gib(budget)} GiB: resident ${fmtBytes(res)}, streaming window ${fmtBytes(win)}, ` +
    `activations ${act == null ? "not measured yet" : fmtBytes(act)}. The line is the budget.`);
  pen.y += barH + 5;
}

/** Without the details: one line, the warning or how many there are. */
function drawWarningLine(pen, warnings) {
  if (!warnings.length) return;
  const { ctx, W } = pen;
  ctx.font = pen.font(12, 600);
  const wt = warnings.length === 1 ? `⚠ ${warnings[0]}` : `⚠ ${warnings.length} warnings: open details`;
  const top = pen.y;
  for (const l of wrapText(ctx, wt, W, WARNING_LINES)) {
    pen.text(l, 0, pen.y + 8, pen.theme.warning, pen.font(12, 600), "left", null, "warning");
    pen.y += 15;
  }
  pen.tip(0, top, W, pen.y - top, warnings.join("\n"));
  pen.y += 2;
}

/**
 * Details: the model in execution order, one bar per segment as wide as its weights, labelled
 * where a whole label fits, its activations in the row above (the tallest full height, so they
 * compare with each other; the tooltip gives the bytes).
 * Returns the name prefix the labels dropped.
 */
function drawSegments(pen, plan, budget) {
  const { ctx, W, theme } = pen;
  const segs = plan.segments;
  const maxAct = Math.max(0, ...segs.map((s) => Number(s.activation_bytes) || 0));
  const actH = maxAct > 0 ? ACT_H : 0;
  const wH = 20;
  const total = segs.reduce((n, s) => n + Math.max(0, Number(s.weight_bytes) || 0), 0);
  const gap = segs.length && W / segs.length >= 4 ? 1 : 0;
  // widths follow the bytes; tiny segments still get a sliver (at most 15% of the width in
  // all goes to these minimums, so the proportions stay true)
  const minW = Math.min(2, (0.15 * W) / Math.max(1, segs.length));
  const free = Math.max(0, W - minW * segs.length);
  const names = segs.map((s) => shortSegmentName(s.name));
  const prefix = sharedPrefix(names);
  const widths = segs.map((s) => minW + (total > 0 ? (Math.max(0, Number(s.weight_bytes) || 0) / total) * free : free / segs.length));
  const drawWs = widths.map((sw) => sw - (sw > 2 ? gap : 0));
  const labelFont = pen.font(11, 600);
  ctx.font = labelFont;
  const labels = pickLabels(ctx, names.map((n) => labelChoices(n, prefix)), drawWs.map((w) => w - 6));
  const colors = segs.map((s) => (s.resident ? COLORS.resident : s.idle ? COLORS.idle : COLORS.streamed));
  const groups = groupLabels(ctx, names.map((n) => n.slice(prefix.length)), colors, labels, widths);
  let sx = 0;
  pen.y += 2;
  const y = pen.y;
  segs.forEach((s, i) => {
    const wb = Math.max(0, Number(s.weight_bytes) || 0);
    const sw = widths[i];
    const color = colors[i];
    const drawW = drawWs[i];
    pen.rect(sx, y + actH, drawW, wH, color);
    const av = Number(s.activation_bytes) || 0;
    if (actH && av > 0) {
      const h = Math.min(actH - 1, Math.max(ACT_MIN_H, (av / maxAct) * (actH - 1)));
      pen.rect(sx, y + actH - 1 - h, drawW, h, COLORS.activation);
    }
    if (labels[i]) pen.text(labels[i], sx + 3, y + actH + wH / 2, inkOn(color), labelFont, "left", color, "segment");
    const where = s.resident ? "resident" : s.idle ? "idle (this call never enters it: never copied)" : "streamed: one copy each call";
    pen.tip(sx, y, sw, actH + wH,
      `${names[i]} · ${where}\n${segmentContents(plan, s)} · ${fmtBytes(wb)} weights · ` +
      (s.activation_bytes == null ? "activations not measured" : `${fmtBytes(av)} activations`));
    if (pen.paint) pen.bars.push({ x: sx, y: y + actH, w: drawW, h: wH, color, label: labels[i], name: names[i] });
    sx += sw;
  });
  for (const g of groups) {
    const x0 = widths.slice(0, g.from).reduce((a, b) => a + b, 0);
    // the label runs across the group's dividers: fill them under it, so none cuts a letter
    ctx.font = labelFont;
    const span = Math.min(ctx.measureText(g.text).width + 6, widths.slice(g.from, g.to + 1).reduce((a, b) => a + b, 0) - gap);
    pen.rect(x0, y + actH, span, wH, colors[g.from]);
    pen.text(g.text, x0 + 3, y + actH + wH / 2, inkOn(colors[g.from]), labelFont, "left", colors[g.from], "segment");
    if (pen.paint) pen.bars.push({ x: x0, y: y + actH, w: widths.slice(g.from, g.to + 1).reduce((a, b) => a + b, 0) - gap,
      h: wH, color: colors[g.from], label: g.text, name: `${g.text}.*`, group: true });
  }
  if (!segs.length) pen.text("no segments", 0, y + actH + wH / 2, theme.muted, pen.font(12));
  pen.y += actH + wH + 4;
  return prefix;
}

/** Counts, the shared prefix dropped from the labels, and the input signature, wrapped: every
 * part whole. */
function drawCounts(pen, m, prefix) {
  const nCopies = Number(m.plan.transfers_per_forward);
  let counts = `${prefix ? `${prefix}* · ` : ""}${blockCount(m.plan)} in ${segmentCounts(m.plan)}` +
    (Number.isFinite(nCopies) && nCopies > 0 ? ` · ${copies(nCopies)} per call` : "");
  if (m.traced_at) counts += ` · traced at ${m.traced_at}`;
  else if (m.inputs) counts += ` · measured at ${m.inputs}`;
  pen.ctx.font = pen.font(12);
  for (const l of wrapText(pen.ctx, counts, pen.W, WARNING_LINES)) {
    pen.text(l, 0, pen.y + 8, pen.theme.muted, pen.font(12), "left", null, "counts");
    pen.y += 16;
  }
  pen.y += 1;
}

/** With the details: every warning, wrapped. */
function drawWarnings(pen, warnings) {
  pen.ctx.font = pen.font(12, 600);
  for (const w of warnings) {
    const lines = wrapText(pen.ctx, `⚠ ${w}`, pen.W, WARNING_LINES);
    const h0 = pen.y;
    for (const l of lines) {
      pen.text(l, 0, pen.y + 8, pen.theme.warning, pen.font(12, 600), "left", null, "warning");
      pen.y += 15;
    }
    pen.tip(0, h0, pen.W, pen.y - h0, w);
  }
}
