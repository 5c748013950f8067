// The colours: the plan's own (resident, streamed, ...) and the page's palette, read from
// ComfyUI's CSS variables each time a plan is drawn, so a palette switch shows at once.
//
// Rule: every colour the plan is drawn in comes from here; the palette is read when asked for,
// never at import (ComfyUI also loads this file on its own as an extension script).

export const FONT_FALLBACK = "Inter, Arial, sans-serif";

// Blue/orange stays distinguishable for the common colour-vision deficiencies.
export const COLORS = {
  resident: "#3b82f6",
  streamed: "#f59e0b",
  activation: "#a78bfa",
  idle: "#6b7280",
  over: "#ef4444",
  measured: "#16a34a",
  traced: "#0d9488",
  weightsOnly: "#64748b",
  warning: "#facc15",
  warningOnLight: "#b45309",
  message: "#ef4444",
  fits: "#22c55e",
  fitsOnLight: "#15803d",
};

function luminance(color) {
  const m = /^#?([0-9a-f]{3}|[0-9a-f]{6})$/i.exec(String(color).trim());
  if (!m) return 0;
  const h = m[1].length === 3 ? m[1].replace(/./g, "$&$&") : m[1];
  const [r, g, b] = [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16) / 255);
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

export function readTheme(el) {
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
