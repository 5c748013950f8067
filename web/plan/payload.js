// The plan as Python sent it: one reading of the payload that every other room draws from.
//
// PAYLOAD = {budget_bytes, enabled, message, message_level?, min_budget_bytes?, min_budget_exact?,
//            need_bytes?,
//            models: [{kind, label, stage ("weights" | "traced" | "measured"), traced_at? (the
//            preview's shape, with stage "traced"), signature, inputs? (the call's inputs in the
//            user's words), warnings, text, refused?, message?, min_budget_bytes?,
//            min_budget_exact?, need_bytes? (a refused model's own figures), plan: {budget_bytes,
//            peak_bytes, streamed_bytes_per_forward, transfers_per_forward, resident_bytes,
//            window_bytes, activation_reserve_bytes, measured, split, units (keep_resident, or
//            "pinned" from older versions), segments, stats?, cost?,
//            devices? (more than one device: [{device, budget_bytes, peak_bytes, resident_bytes,
//            window_bytes, activation_bytes, streamed_bytes_per_call, copies_per_call, segments}]),
//            hops? ([{src, dst, unit, bytes}]), hop_bytes_per_call?, hops_per_call?},
//            time? ({predicted_s, resident_s, added_s, ratio, measured_s, error, source}: the node's
//            time line, per call), refit? ({reason, budget_bytes, previous_budget_bytes}),
//            tiers? (under max_ram_gb: {ram_budget_bytes, ram_bytes, bounce_bytes, host_bytes,
//            disk_bytes, disk_bytes_per_call, disk_s_per_call, disk_bytes_per_s,
//            resident_disk_bytes, units: {device, ram, disk}, tier, load? (measured once the
//            blocks moved: {mapped_bytes, cached_bytes, write_s, released_bytes, move_s,
//            ram_bytes, page_locked_bytes, bounce_bytes})})}],
//  devices? ([{device, budget_bytes (null: free VRAM less the reserve)}]: the Devices node's list)}
// The node-level min_budget_bytes is the largest of the refused models' (the one budget that
// makes every connected model fit: each gets the whole budget in turn).
// Rule: pure functions of the payload (no DOM, no ComfyUI, nothing done at import); they read
// Python's figures and never recompute the plan. ComfyUI also loads this file on its own as an
// extension script, which is harmless only while that stays so.

export function asArray(v) {
  return Array.isArray(v) ? v : [];
}

/** Accept what Python sent; tolerate missing fields (never throw while drawing). */
export function normalizePayload(p) {
  if (!p || typeof p !== "object") return null;
  const positive = (v) => (Number.isFinite(Number(v)) && Number(v) > 0 ? Number(v) : null);
  const models = asArray(p.models)
    .filter((m) => m && typeof m === "object")
    .map((m) => {
      const plan = m.plan && typeof m.plan === "object" ? m.plan : {};
      return {
        kind: String(m.kind ?? "MODEL"),
        label: String(m.label ?? m.kind ?? "model"),
        stage: m.stage === "measured" || m.stage === "traced" ? m.stage : "weights",
        traced_at: m.stage === "traced" && m.traced_at ? String(m.traced_at) : null,
        signature: m.signature ?? null,
        inputs: m.inputs ? String(m.inputs) : null,
        warnings: [...new Set([...asArray(m.warnings), ...asArray(plan.warnings)].map(String))],
        text: String(m.text ?? ""),
        refused: m.refused === true,
        message: m.message ? String(m.message) : null,
        min_budget_bytes: positive(m.min_budget_bytes),
        min_budget_exact: m.min_budget_exact === true,
        need_bytes: positive(m.need_bytes),
        time: isObject(m.time) && Number.isFinite(Number(m.time.predicted_s)) ? m.time : null,
        refit: isObject(m.refit) && Number.isFinite(Number(m.refit.budget_bytes)) ? m.refit : null,
        // under max_ram_gb only: where each block's host copy is (the plan's "tiers")
        tiers: isObject(m.tiers) && Number(m.tiers.ram_budget_bytes) > 0 ? m.tiers
          : isObject(plan.tiers) && Number(plan.tiers.ram_budget_bytes) > 0 ? plan.tiers : null,
        plan: {
          ...plan,
          segments: asArray(plan.segments).filter((s) => s && typeof s === "object"),
          // "pinned" is the older name of keep_resident (must stay on the device)
          units: asArray(plan.units).map((u) => (u && typeof u === "object" && !("keep_resident" in u)
            ? { ...u, keep_resident: u.pinned === true } : u)),
          split: asArray(plan.split).map(String),
          cost: plan.cost && typeof plan.cost === "object" ? plan.cost : null,
          // one row per device only where the plan spans more than one (Python sends none for one)
          devices: asArray(plan.devices).filter((d) => isObject(d) && d.device),
          hops: asArray(plan.hops).filter(isObject),
        },
      };
    });
  return {
    budget_bytes: p.budget_bytes ?? null,
    enabled: p.enabled !== false,
    message: p.message ? String(p.message) : null,
    message_level: p.message_level === "notice" ? "notice" : "error",
    min_budget_bytes: positive(p.min_budget_bytes),
    min_budget_exact: p.min_budget_exact === true,  // the smallest that works, not a lower bound
    need_bytes: positive(p.need_bytes),
    devices: asArray(p.devices).filter((d) => isObject(d) && d.device),
    models,
  };
}

function isObject(v) {
  return !!v && typeof v === "object" && !Array.isArray(v);
}

/** The newest payload of a node's output (a list, newest last) or the payload itself. */
export function lastPayload(list) {
  if (Array.isArray(list)) return list.length ? list[list.length - 1] : null;
  return list && typeof list === "object" ? list : null;
}

// A segment that is not resident streams every step, unless the measured forward never ran it
// ("idle", e.g. the VAE encoder while decoding): the Python side marks those with idle: true.
export function isStreamed(seg) {
  return !seg.resident && !seg.idle;
}

export function isIdle(seg) {
  return !seg.resident && !!seg.idle;
}

/** The blocks of a plan. One saved by an older version (the legacy node property) has its unit
 * list dropped, but each of its segments still names its units. */
export function unitCount(plan) {
  if (plan.units?.length) return plan.units.length;
  return plan.segments.reduce((n, s) => n + asArray(s.units).length, 0);
}

export function summarize(payload) {
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
  if (stages.length) stage = stages.every((s) => s === stages[0]) ? stages[0] : "mixed";
  return { segments, resident, streamed, idle, stage, stages, models: stages.length };
}
