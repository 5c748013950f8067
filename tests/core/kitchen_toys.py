"""Toys whose weights are comfy-kitchen ``QuantizedTensor``s, the type ComfyUI 0.33+ loads fp8,
mxfp8 and nvfp4 checkpoints into (``nn.Parameter(QuantizedTensor(...), requires_grad=False)``,
as ``comfy.ops`` builds them). Import only where comfy_kitchen is installed."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from comfy_kitchen.tensor import QuantizedTensor

# layout name -> the inner tensors it holds (what the executor takes apart)
LAYOUTS = {"fp8": "TensorCoreFP8Layout", "mxfp8": "TensorCoreMXFP8Layout", "nvfp4": "TensorCoreNVFP4Layout"}


class KitchenLinear(nn.Module):
    """A linear layer with a quantized weight, computed the way ComfyUI's ops do on a device
    without the fast kernels: the layer calls ``F.linear`` and the tensor's dispatch dequantizes."""

    def __init__(self, din: int, dout: int, layout: str, g: torch.Generator) -> None:
        super().__init__()
        w = torch.randn(dout, din, generator=g, dtype=torch.float32).to(torch.bfloat16) * 0.2
        self.weight = nn.Parameter(QuantizedTensor.from_float(w, LAYOUTS[layout]), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(dout, generator=g).to(torch.bfloat16) * 0.1, requires_grad=False)

    def forward(self, x):
        assert isinstance(self.weight, QuantizedTensor), "the layer must see a QuantizedTensor"
        return F.linear(x, self.weight, self.bias)


class KitchenBlock(nn.Module):
    def __init__(self, d: int, layout: str, g: torch.Generator) -> None:
        super().__init__()
        self.fc1 = KitchenLinear(d, 2 * d, layout, g)
        self.fc2 = KitchenLinear(2 * d, d, layout, g)
        self.norm = nn.LayerNorm(d).to(torch.bfloat16)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class KitchenStack(nn.Module):
    """A plain input projection, ``depth`` quantized blocks, a plain output layer."""

    def __init__(self, layout: str, d: int = 64, depth: int = 6, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(16, d).to(torch.bfloat16)
        self.blocks = nn.ModuleList(KitchenBlock(d, layout, g) for _ in range(depth))
        self.out = nn.Linear(d, 16).to(torch.bfloat16)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def inputs(batch: int = 4, tokens: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, tokens, 16, generator=g).to(torch.bfloat16),)


def quantized_weights(model: nn.Module) -> list[tuple[str, QuantizedTensor]]:
    return [(n, p) for n, p in model.named_parameters() if isinstance(p, QuantizedTensor)]


def inner(q: QuantizedTensor) -> list[torch.Tensor]:
    names, _ = q.__tensor_flatten__()
    return [getattr(q, n) for n in names]
