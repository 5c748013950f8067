"""A built-in, seeded transformer run plain and segmented: plan, parity, memory, timings."""
from __future__ import annotations

import time

import torch
from torch import nn

from ..engine import Engine, EngineConfig
from ..planning.report import plan_to_json, plan_to_text
from ..model.tensors import fmt_bytes

DEMO_BUDGET_SHARE = 0.4  # default budget: this share of the model's weights


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class DemoBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DemoTransformer(nn.Module):
    """Token embedding, a stack of pre-norm blocks, a final norm and head."""

    def __init__(self, d: int = 1024, depth: int = 8, heads: int = 16, vocab: int = 8192) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DemoBlock(d, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(seed: int = 0, **kw) -> DemoTransformer:
    g = torch.Generator().manual_seed(seed)
    m = DemoTransformer(**kw).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return m


def _time(fn, repeat: int, device: torch.device):
    out = None
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t0) / repeat


def run_demo(budget_bytes: int | None = None, device: str | None = None, repeat: int = 2,
             seed: int = 0, tokens: int = 256, **model_kw) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build(seed, **model_kw)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = budget_bytes or int(weights * DEMO_BUDGET_SHARE)
    ids = torch.randint(0, model.embed.num_embeddings, (1, tokens), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(dev)
    with torch.inference_mode():
        if dev.type == "cuda":
            model.to(dev)
        plain, t_plain = _time(lambda: model(ids), repeat, dev)
        plain = plain.cpu()
        model.to("cpu")
        engine = Engine(model, EngineConfig(budget_bytes=budget, device=str(dev)))
        with engine.session():
            first = engine.run(model, ids)  # the measured forward; plans for this input
            if dev.type == "cpu":  # one metered forward under the plan: its real peak
                engine.executor.track_cpu_memory = True
                engine.run(model, ids)
                engine.executor.track_cpu_memory = False
            out, t_seg = _time(lambda: engine.run(model, ids), repeat, dev)
        measured_stats = engine.stats
        # The same calls with every block resident (a budget the whole model fits in): VRAMCut's
        # hooks and pointer swaps without a copy, which tells the copies' cost from the rest.
        whole = Engine(model, EngineConfig(budget_bytes=2 * weights + (256 << 20), device=str(dev)))
        with whole.session():
            whole.run(model, ids)
            _, t_res = _time(lambda: whole.run(model, ids), repeat, dev)
        assert whole.last_plan.streamed_bytes_per_forward == 0, "the resident run streamed"
    diff = max((first.cpu() - plain).abs().max().item(), (out.cpu() - plain).abs().max().item())
    plan = engine.last_plan
    st = engine.last_stats
    return {
        "device": str(dev),
        "model_weight_bytes": weights,
        "plan": plan_to_json(plan),
        "plan_text": plan_to_text(plan, title=f"plan for {type(model).__name__} on {dev}",
                                  stats=measured_stats, steady=engine.steady_stats),
        "parity_max_abs_diff": diff,
        "peak_device_bytes": measured_stats.peak_device_bytes,
        "peak_weight_bytes": measured_stats.peak_weight_bytes,
        "budget_bytes": budget,
        "bytes_streamed": st.bytes_streamed,
        "time_plain_s": t_plain,
        "time_resident_s": t_res,
        "time_segmented_s": t_seg,
        "time_copy_s": st.time_copy_s,
        "time_wait_s": st.time_wait_s,
    }


def format_demo(r: dict) -> str:
    lines = [r["plan_text"], ""]
    lines.append(f"model weights        {fmt_bytes(r['model_weight_bytes'])}")
    lines.append(f"budget               {fmt_bytes(r['budget_bytes'])}")
    ok = "within budget" if r["peak_device_bytes"] <= r["budget_bytes"] else "OVER BUDGET"
    lines.append(f"peak device (meas.)  {fmt_bytes(r['peak_device_bytes'])}  ({ok})")
    lines.append(f"streamed per call    {fmt_bytes(r['bytes_streamed'])}")
    lines.append(f"parity max |diff|    {r['parity_max_abs_diff']:.3g}")
    ms = {k: r[f"time_{k}_s"] * 1e3 for k in ("plain", "resident", "segmented", "copy", "wait")}
    lines.append(f"time plain           {ms['plain']:.1f} ms / call")
    lines.append(f"time all resident    {ms['resident']:.1f} ms / call: VRAMCut's hooks and pointer swaps, "
                 f"nothing copied ({ms['resident'] - ms['plain']:+.1f} ms)")
    rest = ms["segmented"] - ms["resident"] - ms["wait"]
    lines.append(f"time segmented       {ms['segmented']:.1f} ms / call = all resident "
                 f"{ms['resident']:.1f} + waiting for copies {ms['wait']:.1f} ({ms['copy']:.1f} copying) "
                 f"+ the rest {rest:+.1f} (compute beside the copies, and timing noise)")
    return "\n".join(lines)
