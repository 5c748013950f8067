// The colours: the plan's own (resident, streamed, ...) and the page's palette, read from
// ComfyUI's CSS variables each time a plan is drawn, so a palette switch shows at once.
//
// Rule: every colour the plan is drawn in comes from here; the palette is read when asked for,
// never at import (ComfyUI also loads this file on its own as an extension script).

export const FONT_FALLBACK = "Inter, Arial, sans-serif";

// The plan's fills are Okabe-Ito colours (blue, orange, sky blue), which stay apart under the
// common colour-vision deficiencies (red-green and blue-yellow), in both palettes; idle is a
// neutral grey. Text drawn on a
// fill takes the ink of that fill (INK): at least 4.5:1 contrast, as WCAG asks of small text.
export const COLORS = {
  resident: "#0072b2",
  streamed: "#e69f00",
  activation: "#56b4e9",
  idle: "#6b7280",
  // under max_ram_gb (the RAM bar): flat copies in RAM, the bounce buffer, the blocks on disk
  // (Okabe-Ito's bluish green, reddish purple and vermillion)
  ram: "#009e73",
  bounce: "#cc79a7",
  disk: "#d55e00",
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

function channels(color) {
  const m = /^#?([0-9a-f]{3}|[0-9a-f]{6})$/i.exec(String(color).trim());
  if (!m) return null;
  const h = m[1].length === 3 ? m[1].replace(/./g, "$&$&") : m[1];
  return [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16) / 255);
}

function luminance(color) {
  const c = channels(color);
  return c ? 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2] : 0;
}

/** WCAG relative luminance (linear light). */
function relativeLuminance(color) {
  const c = channels(color);
  if (!c) return 0;
  const lin = c.map((v) => (v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4));
  return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2];
}

/** WCAG contrast ratio of two colours (1 to 21). */
export function contrast(a, b) {
  const [x, y] = [relativeLuminance(a), relativeLuminance(b)].sort((p, q) => q - p);
  return (x + 0.05) / (y + 0.05);
}

/** The text colour for a fill: white or near-black, whichever contrasts more. */
export function inkOn(fill) {
  return contrast("#ffffff", fill) >= contrast("#111111", fill) ? "#ffffff" : "#111111";
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
