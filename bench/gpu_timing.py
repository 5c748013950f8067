"""Predicted against measured time per call, for the GPU checks.

Every check that runs an engine adds ``time_per_call``: the plan's predicted seconds per call
(``Plan.time``, the timeline model), the measured seconds per call (the engine's steady forwards,
timed on the compute stream) and the prediction's error, printed in its line as "predicted
12.3 ms/call, measured 13.0 ms (-5 %)", or "no prediction (why)" where the engine made none
(residency by bytes, no bandwidth figure, several devices).
"""
from __future__ import annotations

import gpu_common  # noqa: F401  (puts the checkout on the import path)
import torch  # noqa: E402

from vramcut_core.figures import speed  # noqa: E402


def _why_no_prediction(eng) -> str:
    """Why ``eng``'s plan carries no predicted time (``planner.timed``'s conditions)."""
    cfg = eng.config
    if len(cfg.devices or ()) > 1:
        return "several devices: the combined plan has no single predicted step"
    if not speed.by_time(cfg):
        return f"speed={cfg.speed} on {torch.device(cfg.device).type}: residency by bytes, no timeline"
    if not speed.Figures.bytes_per_s(cfg):
        return f"no host-to-device bandwidth figure for {cfg.device}"
    return "no compute time for every unit (no FLOP count or no throughput figure)"


def time_per_call(eng, plans=None) -> dict:
    """The plan's predicted seconds per call against the engine's measured steady seconds per call
    (``report.time_to_json``). ``plans``: the plans the timed calls ran in turn (shapes that
    alternate), predicted as their mean; by default the engine's last plan."""
    last = eng.last_plan
    j = {"predicted_s": last.time.predicted_s, "source": last.time.source} if last is not None and last.time else None
    measured = eng.steady_stats.s_per_forward if last is not None and last.measured else None
    if plans is not None:
        times = [p.time for p in plans]
        j = None if any(t is None for t in times) else {
            "predicted_s": sum(t.predicted_s for t in times) / len(times),
            "source": "+".join(sorted({t.source for t in times}))}
    if j is None:
        return {"predicted_s": None, "measured_s": measured, "error": None, "no_prediction": _why_no_prediction(eng)}
    return {"predicted_s": j["predicted_s"], "measured_s": measured, "source": j["source"],
            "error": (j["predicted_s"] - measured) / measured if measured else None}


def time_text(t: dict) -> str:
    """``time_per_call`` as one phrase: "predicted 12.3 ms/call, measured 13.0 ms (-5 %)"."""
    ms = lambda s: f"{s * 1e3:.3g} ms"  # noqa: E731
    meas = "not measured (no steady forward timed)" if t.get("measured_s") is None else f"measured {ms(t['measured_s'])}"
    if t.get("predicted_s") is None:
        return f"no prediction ({t.get('no_prediction')}), {meas}"
    err = f" ({t['error'] * 100:+.0f} %)" if t.get("error") is not None else ""
    return f"predicted {ms(t['predicted_s'])}/call, {meas}{err}"


def time_phrases(res: dict, at: str = "") -> list[str]:
    """Every ``time_per_call`` in a check's result (its own, and its parts'), as phrases."""
    out = []
    for k, v in res.items():
        if k == "time_per_call" and isinstance(v, dict):
            out.append((f"{at}: " if at else "") + time_text(v))
        elif isinstance(v, dict):
            out.extend(time_phrases(v, f"{at}.{k}" if at else k))
    return out
