"""Quantized formats in the engine without ComfyUI: the GGUF header reader against files the
``gguf`` package writes, the header planner's stored bytes per block for .gguf and fp8-scaled
safetensors, and the executor's accounting for flattened subclasses (budget on CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from toys import QuantStack, assert_unchanged, snapshot
from vramcut_core import Engine, EngineConfig
from vramcut_core.model import quant
from vramcut_core.cli.commands import main
from vramcut_core.formats.gguf_header import GGML_TYPES, read_gguf
from vramcut_core.formats.safetensors_plan import HeaderError, plan_units_from_header, read_header


def _blocks(n_blocks=4, d=256):
    """Tensors like a tiny DiT: ``blocks.i.*`` linears, an embedder and a head."""
    g = np.random.default_rng(0)
    sd = {"embed.weight": g.standard_normal((d, 64)).astype(np.float32)}
    for i in range(n_blocks):
        sd[f"blocks.{i}.attn.qkv.weight"] = g.standard_normal((3 * d, d)).astype(np.float32)
        sd[f"blocks.{i}.attn.qkv.bias"] = g.standard_normal((3 * d,)).astype(np.float32)
        sd[f"blocks.{i}.mlp.weight"] = g.standard_normal((d, d)).astype(np.float32)
    sd["final.weight"] = g.standard_normal((16, d)).astype(np.float32)
    return sd


def write_gguf(path, sd, qtype="Q8_0"):
    gguf = pytest.importorskip("gguf", reason="the gguf package (PyPI, in the test extra) writes the test files")
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    w = gguf.GGUFWriter(str(path), arch="sd3")
    w.add_string("general.note", "tiny")
    w.add_array("general.tags", [1, 2, 3])
    for k, a in sd.items():
        if a.ndim == 2 and a.shape[1] % block == 0 and k.startswith("blocks."):
            if qtype.endswith("_K"):
                q = np.random.default_rng(1).integers(0, 256, (a.shape[0], a.shape[1] // block * size), dtype=np.uint8)
            else:
                q = gguf.quants.quantize(a, qt)
            w.add_tensor(k, q, raw_shape=q.shape, raw_dtype=qt)
        elif k == "final.weight":
            w.add_tensor(k, a.astype(np.float16))
        else:
            w.add_tensor(k, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_ggml_type_table_matches_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    for tid, (name, block, size) in GGML_TYPES.items():
        qt = gguf.GGMLQuantizationType(tid)
        assert qt.name == name and gguf.GGML_QUANT_SIZES[qt] == (block, size), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_gguf_header_reader_matches_the_gguf_reader(tmp_path, qtype):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / f"m_{qtype}.gguf"
    write_gguf(path, _blocks(), qtype)
    meta, tensors = read_gguf(str(path))
    assert meta["general.architecture"] == "sd3" and meta["general.tags"] == [1, 2, 3]
    ref = gguf.GGUFReader(str(path))
    assert set(tensors) == {t.name for t in ref.tensors}
    data_start = min(int(t.data_offset) for t in ref.tensors)
    for t in ref.tensors:
        mine = tensors[t.name]
        assert mine["dtype"] == t.tensor_type.name, t.name
        assert mine["shape"] == [int(x) for x in reversed(t.shape)], t.name
        a, b = mine["data_offsets"]
        assert b - a == int(t.n_bytes), t.name
        assert data_start + a == int(t.data_offset), t.name
    quantized = [v for k, v in tensors.items() if k.endswith("qkv.weight")]
    assert quantized and all(v["dtype"] == qtype for v in quantized)


def test_plan_cli_reads_gguf_stored_bytes_per_block(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    sd = _blocks()
    write_gguf(path, sd, "Q8_0")
    units = {u.name: u.weight_bytes for u in plan_units_from_header(read_gguf(str(path))[1])}
    d = 256
    q8 = lambda rows, cols: rows * cols // 32 * 34  # noqa: E731  (Q8_0: 34 bytes per 32 weights)
    per_block = q8(3 * d, d) + q8(d, d) + 3 * d * 4     # bias stays F32
    assert [units[f"blocks.{i}"] for i in range(4)] == [per_block] * 4
    fp32_block = sum(a.nbytes for k, a in sd.items() if k.startswith("blocks.0."))
    assert per_block < fp32_block * 0.3
    assert main(["plan", str(path), "--max-vram", str(3 * per_block / 2**30)]) == 0
    out = capsys.readouterr().out
    assert "Q8_0" in out and "stored bytes" in out


def test_plan_cli_reports_fp8_scaled_safetensors_by_stored_bytes(tmp_path, capsys):
    from safetensors.torch import save_file
    sd = {k: torch.from_numpy(a) for k, a in _blocks().items()}
    q = {}
    for k, v in sd.items():
        if k.startswith("blocks.") and k.endswith(".weight"):
            scale = v.abs().amax() / 448
            q[k] = (v / scale).to(torch.float8_e4m3fn)
            q[k[:-len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            q[k] = v
    q["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    path = tmp_path / "m_fp8_scaled.safetensors"
    save_file(q, str(path))
    units = {u.name: u.weight_bytes for u in plan_units_from_header(read_header(str(path)))}
    d = 256
    assert units["blocks.2"] == 3 * d * d + d * d + 2 * 4 + 3 * d * 4  # fp8 weights, fp32 scales and bias
    assert main(["plan", str(path), "--max-vram", "0.01"]) == 0
    assert "F8_E4M3" in capsys.readouterr().out


def test_gguf_reader_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 8)
    with pytest.raises(HeaderError, match="not a GGUF file"):
        read_gguf(str(bad))
    path = tmp_path / "m.gguf"
    write_gguf(path, _blocks(), "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(HeaderError, match="beyond the end of the file"):
        read_gguf(str(cut))
    with pytest.raises(HeaderError, match="no such file"):
        read_gguf(str(tmp_path / "missing.gguf"))


def test_flattened_subclass_weights_are_accounted_exactly_and_fit_the_budget():
    """A streamed subclass unit occupies its stored bytes inside the slots: the executor's
    accounted device bytes are the plan's (resident + window), none beside them, and the measured
    peak (weights + activations) stays within the budget."""
    torch.manual_seed(0)
    model = QuantStack(d=32, depth=6).eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = model(x)
        snap = snapshot(model)
        w = model.blocks[0][0].weight
        assert quant.kind(w) == quant.STORAGE and quant.parts(w)[0].dtype == torch.float32
        unit_bytes = 4096 + 256 + 256  # the weight's bytes, LayerNorm weight and bias, each aligned
        probe = Engine(model, EngineConfig(budget_bytes=1 << 40, device="cpu"))
        probe.run(model, x)
        act = probe.last_plan.activation_reserve_bytes
        budget = 3 * unit_bytes + act + 512  # a window of two slots and one unit resident
        eng = Engine(model, EngineConfig(budget_bytes=budget, device="cpu", track_cpu_memory=True))
        for u in eng.unitset.units:
            if u.name.startswith("blocks."):
                lay = eng.executor.memory.layout(u.name)
                assert lay.other == [] and list(lay.quant) == [0]
                assert eng.executor.unit_device_bytes(u.name) == unit_bytes
        with eng.session():
            out = eng.run(model, x)
            out = eng.run(model, x)
        assert torch.equal(out, ref)
        assert_unchanged(model, snap)
        plan = eng.last_plan
        assert plan.streamed_bytes_per_forward > 0
        assert not any("cannot be taken apart" in w for w in plan.warnings)
        assert eng.stats.peak_weight_bytes <= plan.resident_bytes + plan.window_bytes
        assert eng.stats.peak_device_bytes <= budget


class Opaque(torch.Tensor):
    """A wrapper subclass with its own dispatch and no flatten protocol: cannot be taken apart."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_formats_that_cannot_be_taken_apart_are_named_in_the_plan():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)])
    w = Opaque(torch.randn(16, 16))
    assert quant.parts(w) is None
    model[2]._parameters["weight"] = w
    eng = Engine(model, EngineConfig(budget_bytes=1 << 30, device="cpu"))
    plan = eng.weight_plan()
    assert any("Opaque" in m and "cannot be taken apart" in m for m in plan.warnings)
