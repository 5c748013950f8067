// The segment bars' labels: whole, distinct and meaningful, or none (the tooltip names every bar).
//
// A label is a segment's name shortened by dotted parts ("decoder.up.3" -> "up.3"), never cut
// with an ellipsis; a run of unlabelled bars of one kind whose names share a first part is
// labelled once across them ("encoder"). Rule: pure functions of the names and the widths (the
// context only measures text); nothing done at import (ComfyUI also loads this file on its own as
// an extension script).

/**
 * The labels a segment bar can carry, longest first: its name less the model's shared prefix,
 * then with leading dotted parts dropped while two remain ("decoder.up.3" -> "up.3", never "3"),
 * for a range each end so ("decoder.conv_in…decoder.mid.block_2" -> "conv_in…block_2").
 */
export function labelChoices(name, prefix) {
  const ends = String(name).slice(prefix.length).split("…").map((e) => e.split("."));
  const shorter = (p) => p.map((_, i) => p.slice(i).join(".")).filter((_, i) => i === 0 || p.length - i >= 2);
  if (ends.length !== 2) return shorter(ends[0]);
  const out = [];
  for (const a of shorter(ends[0])) for (const b of shorter(ends[1])) out.push(`${a}…${b}`);
  return [...new Set(out)].sort((x, y) => y.length - x.length);
}

/** For each bar (width `room[i]`), the longest of its labels that fits whole and that no other
 * segment could be labelled by; null where none fits (the tooltip names it). */
export function pickLabels(ctx, choices, room) {
  const owners = new Map();
  choices.forEach((c, i) => c.forEach((t) => owners.set(t, owners.has(t) && owners.get(t) !== i ? -1 : i)));
  return choices.map((c, i) => c.find((t) => owners.get(t) === i && ctx.measureText(t).width <= room[i]) ?? null);
}

/** Runs of unlabelled bars of one colour whose names share a first part ("encoder."): labelled
 * together with that part where it fits across them. [{from, to, text}] */
export function groupLabels(ctx, names, colors, labels, room) {
  const out = [];
  const first = (n) => (n.includes(".") ? n.split(".")[0] : null);
  let i = 0;
  while (i < names.length) {
    let j = i;
    const key = first(names[i]);
    while (key && j + 1 < names.length && !labels[j + 1] && !labels[i] && first(names[j + 1]) === key &&
      colors[j + 1] === colors[i]) j++;
    const width = room.slice(i, j + 1).reduce((a, b) => a + b, 0);
    if (j > i && ctx.measureText(key).width <= width) out.push({ from: i, to: j, text: key });
    i = j + 1;
  }
  return out;
}
