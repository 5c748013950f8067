"""Tiny models shaped like the families the engine claims, built in the tests (seeded)."""
from __future__ import annotations

import torch
from torch import nn


def seeded(m: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dtype.is_floating_point and p.dtype.itemsize >= 2:
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
    return m.eval()


def map_from_file(m: nn.Module, folder: str, fmt: str = "safetensors") -> nn.Module:
    """``m`` with every tensor of its state dict replaced (``assign``) by one mapped from a
    checkpoint of itself written into ``folder``, as a host keeps a model it streams from a fast
    disk: ``safetensors`` (``safe_open``) or ``torch_mmap`` (``torch.load(mmap=True)``)."""
    import os

    import safetensors
    import safetensors.torch

    sd = {k: v.detach().contiguous() for k, v in m.state_dict().items()}
    if fmt == "safetensors":
        path = os.path.join(folder, "model.safetensors")
        safetensors.torch.save_file(sd, path)
        with safetensors.safe_open(path, framework="pt") as f:
            mapped = {k: f.get_tensor(k) for k in f.keys()}
    else:
        path = os.path.join(folder, "model.pt")
        torch.save(sd, path)
        mapped = torch.load(path, mmap=True, weights_only=True)
    m.load_state_dict(mapped, assign=True)
    return m


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TransformerStack(nn.Module):
    """Embedding, a block list, a head: the shape of most DiTs and text encoders."""

    def __init__(self, d: int = 32, depth: int = 6, vocab: int = 50, list_name: str = "blocks") -> None:
        super().__init__()
        self.list_name = list_name
        self.embed = nn.Embedding(vocab, d)
        setattr(self, list_name, nn.ModuleList(MLPBlock(d) for _ in range(depth)))
        self.norm_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, 8)

    def forward(self, ids):
        x = self.embed(ids)
        for b in getattr(self, self.list_name):
            x = b(x)
        return self.head(self.norm_out(x))


class FluxLike(nn.Module):
    """Two block lists (double then single), as Flux/Chroma/HunyuanVideo, plus a root parameter."""

    def __init__(self, d: int = 32, n_double: int = 3, n_single: int = 4) -> None:
        super().__init__()
        self.img_in = nn.Linear(16, d)
        self.time_in = nn.Linear(1, d)
        self.pos = nn.Parameter(torch.zeros(1, 1, d))   # read by the root's own forward
        self.double_blocks = nn.ModuleList(MLPBlock(d) for _ in range(n_double))
        self.single_blocks = nn.ModuleList(MLPBlock(d) for _ in range(n_single))
        self.final_layer = nn.Linear(d, 16)

    def forward(self, x, t):
        h = self.img_in(x) + self.time_in(t[:, None, None]) + self.pos
        for b in self.double_blocks:
            h = b(h)
        for b in self.single_blocks:
            h = b(h)
        return self.final_layer(h) + self.pos.sum()


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, cin)
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        return self.skip(x) + self.conv(torch.nn.functional.silu(self.norm(x)))


class EmbedSequential(nn.Sequential):
    """Like ComfyUI's TimestepEmbedSequential: the UNet calls its children directly."""


class UNetLike(nn.Module):
    """input_blocks / middle_block / output_blocks with skip connections that cross many units.
    The forward iterates each block's children itself, never calling the block."""

    def __init__(self, ch: int = 8, levels: int = 3) -> None:
        super().__init__()
        self.time_embed = nn.Sequential(nn.Linear(1, ch), nn.SiLU(), nn.Linear(ch, ch))
        self.input_blocks = nn.ModuleList([EmbedSequential(nn.Conv2d(4, ch, 3, padding=1))])
        for _ in range(levels):
            self.input_blocks.append(EmbedSequential(ResBlock(ch, ch)))
        self.middle_block = EmbedSequential(ResBlock(ch, ch), ResBlock(ch, ch))
        self.output_blocks = nn.ModuleList(EmbedSequential(ResBlock(2 * ch, ch)) for _ in range(levels + 1))
        self.out = nn.Sequential(nn.GroupNorm(4, ch), nn.SiLU(), nn.Conv2d(ch, 4, 3, padding=1))

    @staticmethod
    def _run(seq, x, emb):
        for layer in seq:   # children called directly, as ComfyUI's forward_timestep_embed does
            x = layer(x)
        return x + emb[:, :, None, None]

    def forward(self, x, t):
        emb = self.time_embed(t[:, None])
        hs = []
        h = x
        for blk in self.input_blocks:
            h = self._run(blk, h, emb) if not isinstance(blk[0], nn.Conv2d) else blk[0](h)
            hs.append(h)
        h = self._run(self.middle_block, h, emb)
        for blk in self.output_blocks:
            h = self._run(blk, torch.cat([h, hs.pop()], dim=1), emb)
        return self.out(h)


class TiedStack(TransformerStack):
    """The head shares the embedding's weight; one block is registered twice in the list."""

    def __init__(self, d: int = 32, depth: int = 4, vocab: int = 50) -> None:
        super().__init__(d, depth, vocab)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm_out(x))


class BufferedStack(nn.Module):
    """Blocks with buffers (running statistics, a persistent scale and a non-persistent table)."""

    def __init__(self, d: int = 16, depth: int = 5) -> None:
        super().__init__()
        self.proj = nn.Linear(8, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d)) for _ in range(depth))
        for i, b in enumerate(self.blocks):
            b.register_buffer("scale", torch.tensor(1.0 + i / 10))
            b.register_buffer("table", torch.arange(d, dtype=torch.float32) / d, persistent=False)
        self.final = nn.Linear(d, 3)

    def forward(self, x):
        h = self.proj(x)
        for b in self.blocks:
            h = torch.tanh(b(h)) * b.scale + b.table
        return self.final(h)


class Fp8Linear(nn.Module):
    """Weights stored in fp8, cast to the compute dtype per forward (as fp8 checkpoints run)."""

    def __init__(self, din: int, dout: int, dtype=torch.float8_e4m3fn) -> None:
        super().__init__()
        w = torch.randn(dout, din) * 0.1
        self.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dout, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class MixedDtypeStack(nn.Module):
    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d).to(torch.bfloat16)
        self.blocks = nn.ModuleList(
            nn.Sequential(Fp8Linear(d, d), nn.LayerNorm(d).to(torch.bfloat16)) for _ in range(depth))
        self.out = nn.Linear(d, d, dtype=torch.float16)

    def forward(self, x):
        h = self.inp(x.to(torch.bfloat16))
        for b in self.blocks:
            h = h + b(h)
        return self.out(h.to(torch.float16))


class ScaledTensor(torch.Tensor):
    """A wrapper tensor subclass with metadata, the way quantized weight types carry theirs."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float):
        t = torch.Tensor._make_subclass(cls, data, False)
        t.scale = scale
        return t

    def to(self, *args, **kwargs):
        return ScaledTensor(self.as_subclass(torch.Tensor).to(*args, **kwargs), self.scale)

    def detach(self):
        return ScaledTensor(self.as_subclass(torch.Tensor).detach(), self.scale)


class QuantLinear(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(ScaledTensor(torch.randn(d, d) * 0.1, 0.5), requires_grad=False)

    def forward(self, x):
        w = self.weight
        assert isinstance(w, ScaledTensor) and w.scale == 0.5, "subclass metadata lost"
        return x @ w.as_subclass(torch.Tensor).t() * w.scale


class QuantStack(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(QuantLinear(d), nn.LayerNorm(d)) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


class Temp(nn.Module):
    """A large temporary, freed before the module returns (``k`` times its input)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        big = x.unsqueeze(-1).expand(*x.shape, self.k).contiguous()
        return x + big.amax(-1)


class TempBlock(nn.Module):
    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.a, self.temp, self.b, self.c = nn.Linear(d, d), Temp(k), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.temp(self.a(x)))))


class TempStack(nn.Module):
    def __init__(self, d: int = 64, depth: int = 6, k: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(TempBlock(d, k) for _ in range(depth))
        self.out = nn.Linear(d, 16)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class Boom(Exception):
    pass


class ExplodingStack(TransformerStack):
    """Raises from inside block ``at`` when armed."""

    def __init__(self, at: int = 3, **kw) -> None:
        super().__init__(**kw)
        self.at, self.armed = at, False

    def forward(self, ids):
        x = self.embed(ids)
        for i, b in enumerate(self.blocks):
            x = b(x)
            if self.armed and i == self.at:
                raise Boom(f"boom in block {i}")
        return self.head(self.norm_out(x))


def snapshot(m: nn.Module) -> dict:
    """Every parameter and buffer: the object, its device, and a copy of its values."""
    out = {}
    for n, t in list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)):
        out[n] = (t, t.device, t.data_ptr(), t.detach().clone())
    return out


def assert_unchanged(m: nn.Module, snap: dict) -> None:
    now = dict(list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)))
    assert set(now) == set(snap)
    for n, (t, dev, ptr, vals) in snap.items():
        assert now[n] is t, f"{n}: tensor object replaced"
        assert now[n].device == dev, f"{n}: moved to {now[n].device}"
        assert now[n].data_ptr() == ptr, f"{n}: points at other memory (a device copy left swapped in?)"
        assert torch.equal(now[n].detach().view(torch.uint8) if now[n].dtype.itemsize == 1 else now[n].detach(),
                           vals.view(torch.uint8) if vals.dtype.itemsize == 1 else vals), f"{n}: values changed"


class JointBlock(nn.Module):
    """An MMDiT double block: image and text streams, modulated by ``vec``, attending jointly."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mod = nn.Linear(d, 2 * d)
        self.img = MLPBlock(d)
        self.txt = MLPBlock(d)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, img, txt, vec, pe):
        scale, shift = self.mod(vec)[:, None].chunk(2, dim=-1)
        x = torch.cat([txt, img], dim=1) * (1 + scale) + shift + pe
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v)
        n = txt.shape[1]
        return self.img(x[:, n:]), self.txt(x[:, :n])


class SingleBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mod = nn.Linear(d, d)
        self.mlp = MLPBlock(d)

    def forward(self, x, vec, pe):
        return self.mlp(x + self.mod(vec)[:, None] + pe)


class MMDiTLike(nn.Module):
    """Flux/MMDiT's shape: a prelude computing ``vec`` and ``pe`` read by every block (passed as
    keyword arguments), double blocks over two streams, the streams joined outside any block,
    single blocks, and a final layer that reads ``vec`` again."""

    def __init__(self, d: int = 32, n_double: int = 3, n_single: int = 4) -> None:
        super().__init__()
        self.img_in = nn.Linear(16, d)
        self.txt_in = nn.Linear(12, d)
        self.time_in = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.pe_in = nn.Linear(2, d)
        self.double_blocks = nn.ModuleList(JointBlock(d) for _ in range(n_double))
        self.single_blocks = nn.ModuleList(SingleBlock(d) for _ in range(n_single))
        self.final_mod = nn.Linear(d, d)
        self.final_layer = nn.Linear(d, 16)

    def forward(self, x, context, t, pos):
        img, txt = self.img_in(x), self.txt_in(context)
        vec = self.time_in(t[:, None])
        pe = self.pe_in(pos)
        for b in self.double_blocks:
            img, txt = b(img, txt, vec=vec, pe=pe)
        h = torch.cat([txt, img], dim=1)
        for b in self.single_blocks:
            h = b(h, vec=vec, pe=pe)
        h = h[:, txt.shape[1]:]
        return self.final_layer(h * (1 + self.final_mod(vec)[:, None]))


class VideoBlock(nn.Module):
    """A Wan-like block: self-attention over the video tokens, cross-attention to the text
    context, an MLP, modulated by the time embedding ``e``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mod = nn.Linear(d, 2 * d)
        self.qkv = nn.Linear(d, 3 * d)
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.ffn = MLPBlock(d)

    def forward(self, x, e, context):
        scale, shift = self.mod(e)[:, None].chunk(2, dim=-1)
        h = x * (1 + scale) + shift
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v)
        k, v = self.kv(context).chunk(2, dim=-1)
        x = x + torch.nn.functional.scaled_dot_product_attention(self.q(x), k, v)
        return self.ffn(x)


class VideoDiTLike(nn.Module):
    """Wan's shape: a 3-D patch embedding of (B, C, F, H, W) latents, a text embedding, one list
    of blocks, a head that unpatchifies."""

    def __init__(self, d: int = 32, depth: int = 6, c: int = 4) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv3d(c, d, (1, 2, 2), stride=(1, 2, 2))
        self.text_embedding = nn.Sequential(nn.Linear(12, d), nn.GELU(), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(VideoBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, c * 4)

    def forward(self, x, t, context):
        b, c, f, hh, ww = x.shape
        h = self.patch_embedding(x).flatten(2).transpose(1, 2)
        e = self.time_embedding(t[:, None])
        ctx = self.text_embedding(context)
        for blk in self.blocks:
            h = blk(h, e=e, context=ctx)
        out = self.head(h).view(b, f, hh // 2, ww // 2, c, 2, 2)
        return out.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, hh, ww)


class OptionsBlock(nn.Module):
    """A block that writes into the containers it is given, as ComfyUI's blocks write into
    ``transformer_options``: a counter and a tensor into a dict, an index appended to a list.
    The next block reads what the last one wrote."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ffn = MLPBlock(d)

    def forward(self, x, opts, trail):
        carry = opts.get("carry")
        if carry is not None:
            x = x + carry
        x = self.ffn(x) * (1 + opts["count"] + len(trail))
        opts["count"] = opts["count"] + 1
        opts["carry"] = x.mean(dim=1, keepdim=True)
        trail.append(opts["count"])
        return x


class OptionsDiT(nn.Module):
    """A chain of ``OptionsBlock``s over options made per call (``opts``, ``trail``). With
    ``mix``, the code after the blocks mixes the last written ``carry`` with a tensor computed at
    the start: a model whose outer code reads what a block wrote, where that block computed."""

    def __init__(self, d: int = 32, depth: int = 8, mix: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(12, d)
        self.blocks = nn.ModuleList(OptionsBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, 12)
        self.mix = mix

    def forward(self, x):
        start = x.mean()
        opts, trail = {"count": 0}, []
        h = self.embed(x)
        for b in self.blocks:
            h = b(h, opts, trail=trail)
        out = self.head(h) * (opts["count"] + len(trail))
        if self.mix:
            out = out + start * opts["carry"].mean()
        return out
