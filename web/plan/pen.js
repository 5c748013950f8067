// The pen the draw functions share: text fitted and wrapped to a width, rounded rectangles, and
// the record of every text box, bar and hover region drawn (what the node's layout checks and the
// browser tests read).
// Rule: touch no DOM but the canvas context, and do nothing at import (ComfyUI also loads this
// file on its own as an extension script).

export function fitText(ctx, text, maxW) {
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

export function wrapText(ctx, text, maxW, maxLines = 4) {
  const words = String(text).split(/\s+/).filter(Boolean).flatMap((w) => breakWord(ctx, w, maxW));
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

/** A word wider than the line (a long module path) in pieces that fit: after its dots where it
 * has them, else anywhere; so it wraps whole instead of being cut. */
function breakWord(ctx, word, maxW) {
  if (ctx.measureText(word).width <= maxW) return [word];
  const pieces = [];
  let cur = "";
  for (const part of word.split(/(?<=\.)/)) {
    for (const ch of ctx.measureText(part).width <= maxW ? [part] : [...part]) {
      if (cur && ctx.measureText(cur + ch).width > maxW) {
        pieces.push(cur);
        cur = "";
      }
      cur += ch;
    }
  }
  if (cur) pieces.push(cur);
  return pieces;
}

export function roundRect(ctx, x, y, w, h, r) {
  r = Math.max(0, Math.min(r, w / 2, h / 2));
  ctx.beginPath();
  ctx.moveTo(x + r, y);
  ctx.arcTo(x + w, y, x + w, y + h, r);
  ctx.arcTo(x + w, y + h, x, y + h, r);
  ctx.arcTo(x, y + h, x, y, r);
  ctx.arcTo(x, y, x + w, y, r);
  ctx.closePath();
}

/** A bar's track, from the left to its budget line (`w` wide): the page's input background, framed. */
export function paintTrack(pen, y, w, h) {
  if (!pen.paint) return;
  const { ctx, theme } = pen;
  ctx.save();
  roundRect(ctx, 0, y, Math.max(1, w), h, 3);
  ctx.fillStyle = theme.track;
  ctx.fill();
  ctx.strokeStyle = theme.border;
  ctx.lineWidth = 1;
  ctx.stroke();
  ctx.restore();
}

/**
 * What the draw functions share: the context, the width W, the theme, `paint` (off: measure
 * only), the running `y` and the hover regions [{x, y, w, h, tip, section?}].
 */
export function makePen(ctx, W, theme, paint) {
  return {
    ctx,
    W,
    theme,
    paint,
    y: 0,
    regions: [],
    // every text drawn, with its box and the fill under it when there is one (what the tests and
    // the node's layout checks read: nothing may be cut or drawn under the buttons)
    texts: [],
    bars: [],
    font: (size, weight = 400) => `${weight} ${size}px ${theme.font}`,
    text(s, x, y, color, font, align = "left", bg = null, kind = null) {
      if (!paint) return;
      ctx.font = font;
      ctx.fillStyle = color;
      ctx.textAlign = align;
      ctx.textBaseline = "middle";
      ctx.fillText(s, x, y);
      const w = ctx.measureText(s).width;
      const left = align === "center" ? x - w / 2 : align === "right" ? x - w : x;
      const size = Number(/(\d+(?:\.\d+)?)px/.exec(font)?.[1] ?? 12);
      this.texts.push({ text: String(s), x: left, y: y - size / 2, w, h: size, color, size, bg, kind });
    },
    rect(x, y, w, h, color) {
      if (!paint || w <= 0 || h <= 0) return;
      ctx.fillStyle = color;
      ctx.fillRect(x, y, w, h);
    },
    tip(x, y, w, h, tip) {
      this.regions.push({ x, y, w, h, tip });
    },
  };
}
