import pytest
import torch
from torch import nn

from toys import (BufferedStack, FluxLike, MixedDtypeStack, QuantStack, TiedStack, TransformerStack,
                  UNetLike, seeded)
from unit_checks import assert_partition
from vramcut_core import find_units, split_unit
from vramcut_core.model.tensors import tensor_nbytes


class DiT(nn.Module):
    """A root-level family toy: each registry entry's block lists, a prelude and a final layer."""

    def __init__(self, lists, requires=(), d=8, n=3):
        super().__init__()
        self.x_in = nn.Linear(d, d)
        for r in requires:
            setattr(self, r, nn.Linear(d, d))
        for path in lists:
            parent = self
            *heads, last = path.split(".")
            for h in heads:
                if not hasattr(parent, h):
                    setattr(parent, h, nn.Module())
                parent = getattr(parent, h)
            setattr(parent, last, nn.ModuleList(nn.Linear(d, d) for _ in range(n)))
        self.final_layer = nn.Linear(d, d)


FAMILY_TOYS = [
    ("flux", ["double_blocks", "single_blocks"], ()),
    ("hidream", ["double_stream_blocks", "single_stream_blocks"], ()),
    ("mmdit", ["joint_blocks"], ()),
    ("lumina2", ["noise_refiner", "context_refiner", "layers"], ()),
    ("wan", ["blocks", "vace_blocks"], ("patch_embedding",)),
    ("qwen_image", ["transformer_blocks"], ("img_in", "txt_in")),
]


@pytest.mark.parametrize("family,lists,requires", FAMILY_TOYS, ids=[f[0] for f in FAMILY_TOYS])
def test_root_families_find_their_block_lists(family, lists, requires):
    m = DiT(lists, requires)
    us = find_units(m)
    assert us.family == family
    blocks = [u.name for u in us.units if u.kind == "block"]
    assert blocks == [f"{lst}.{i}" for lst in lists for i in range(3)]
    assert us.units[0].name == "prelude" and us.units[-1].name == "final_layer"
    assert us.units[-1].kind == "final"
    assert not us.warnings
    assert_partition(m, us)


def test_wan_without_vace_blocks_still_matches():
    m = DiT(["blocks"], ("patch_embedding",))
    assert find_units(m).family == "wan"


def test_unet_units_and_skip_model():
    m = UNetLike()
    us = find_units(m)
    assert us.family == "unet"
    names = [u.name for u in us.units]
    assert names[0] == "prelude" and names[-1] == "out"
    assert "middle_block" in names
    assert [n for n in names if n.startswith("input_blocks")] == [f"input_blocks.{i}" for i in range(4)]
    assert_partition(m, us)
    # the UNet calls the blocks' children, not the blocks: the children are hook points
    blk = us.by_name["output_blocks.0"]
    assert blk.roots[0][1][0] in blk.hook_modules or any(
        isinstance(h, nn.Conv2d) for h in blk.hook_modules)


def test_text_encoders_are_found_nested_per_component():
    class Enc(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.text_model = nn.Module()
            self.transformer.text_model.embeddings = nn.Embedding(10, 8)
            self.transformer.text_model.encoder = nn.Module()
            self.transformer.text_model.encoder.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
            self.transformer.text_model.final_layer_norm = nn.LayerNorm(8)

    class T5(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.encoder = nn.Module()
            self.transformer.encoder.block = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.transformer.encoder.final_layer_norm = nn.LayerNorm(8)
            self.transformer.shared = nn.Embedding(10, 8)  # registered after, runs first

    class SD3Clip(nn.Module):
        def __init__(self):
            super().__init__()
            self.clip_l, self.clip_g, self.t5xxl = Enc(2), Enc(3), T5()

    m = SD3Clip()
    us = find_units(m)
    assert us.family == "text_encoder"
    names = [u.name for u in us.units]
    assert "clip_l.prelude" in names and "clip_g.transformer.text_model.final_layer_norm" in names
    assert "t5xxl.prelude" in names  # the embedding is a prelude wherever it is registered
    assert "clip_g.transformer.text_model.encoder.layers.2" in names
    assert "t5xxl.transformer.encoder.block.0" in names
    assert_partition(m, us)


def test_sd_vae_levels():
    class Coder(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.conv_in = nn.Conv2d(3, 4, 1)
            setattr(self, name, nn.ModuleList(nn.Conv2d(4, 4, 1) for _ in range(3)))
            self.mid = nn.Sequential(nn.Conv2d(4, 4, 1))
            self.conv_out = nn.Conv2d(4, 3, 1)

    class VAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = Coder("down"), Coder("up")
            self.quant_conv = nn.Conv2d(4, 4, 1)

    m = VAE()
    us = find_units(m)
    assert us.family == "sd_vae"
    names = [u.name for u in us.units]
    for n in ("encoder.down.0", "encoder.mid", "decoder.mid", "decoder.up.2", "encoder.prelude", "decoder.conv_out"):
        assert n in names
    assert_partition(m, us)


def test_generic_fallback_warns_and_finds_blocks():
    m = TransformerStack(list_name="stack")
    us = find_units(m)
    assert us.family == "generic"
    assert [u.name for u in us.units if u.kind == "block"] == [f"stack.{i}" for i in range(6)]
    assert us.warnings and "generic fallback" in us.warnings[0]
    assert_partition(m, us)


def test_model_without_blocks_gets_units_not_a_crash():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    us = find_units(m)
    assert us.units and us.warnings
    assert_partition(m, us)


def test_unknown_family_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        find_units(nn.Linear(2, 2), family="nope")


def test_tied_weights_and_container_parameters_go_to_shared():
    m = TiedStack()
    us = find_units(m)
    shared = us.by_name["shared"]
    assert shared.keep_resident
    assert any(t.tensor is m.embed.weight for t in shared.tensors)
    assert len([r for t in shared.tensors for r in t.refs if t.tensor is m.embed.weight]) == 2
    assert_partition(m, us)
    f = FluxLike()
    uf = find_units(f)
    assert [t.tensor for t in uf.by_name["shared"].tensors] == [f.pos]


def test_buffers_belong_to_units():
    m = BufferedStack()
    us = find_units(m)
    assert_partition(m, us)
    b0 = us.by_name["blocks.0"]
    assert {r.key for t in b0.tensors for r in t.refs} >= {"scale", "table", "running_mean", "weight"}


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2),
                                         (torch.float8_e4m3fn, 1), (torch.float8_e5m2, 1)])
def test_exact_weight_bytes_per_dtype(dtype, size):
    m = nn.Sequential(*[nn.Linear(7, 5) for _ in range(4)]).to(dtype)
    us = find_units(m)
    assert us.weight_bytes == 4 * (7 * 5 + 5) * size
    assert sum(u.weight_bytes for u in us.units) == us.weight_bytes


def test_mixed_dtype_and_subclass_bytes():
    m = MixedDtypeStack()
    us = find_units(m)
    expect = sum(p.numel() * p.element_size() for p in m.parameters())
    assert us.weight_bytes == expect
    q = QuantStack()
    uq = find_units(q)
    assert uq.weight_bytes == sum(tensor_nbytes(p) for p in q.parameters())


def test_split_unit_into_children_with_a_self_kept_resident():
    m = FluxLike()
    blk = m.double_blocks[0]
    blk.gate = nn.Parameter(torch.ones(3))  # read by the block's own forward
    us = find_units(m)
    parts = split_unit(us.by_name["double_blocks.0"])
    names = [p.name for p in parts]
    assert names[0] == "double_blocks.0.self" and parts[0].keep_resident
    assert {"double_blocks.0.norm", "double_blocks.0.fc1", "double_blocks.0.fc2"} <= set(names)
    assert sum(p.weight_bytes for p in parts) == us.by_name["double_blocks.0"].weight_bytes
    assert split_unit(split_unit(us.by_name["double_blocks.0"])[1]) is None  # a LayerNorm: a leaf


def test_every_unit_has_hook_modules_except_shared():
    for m in (TransformerStack(), UNetLike(), FluxLike(), BufferedStack(), seeded(TiedStack())):
        for u in find_units(m).units:
            assert u.kind == "shared" or u.hook_modules, u.name


def test_modules_registered_after_the_blocks_get_units_of_their_own():
    """Some models register embedders after their blocks (HiDream's caption projection, Lumina2's
    t/cap embedders): each such module is its own unit, so a forward enters it once and the
    measured order puts it where it runs."""

    class LateEmbedder(nn.Module):
        def __init__(self):
            super().__init__()
            self.x_in = nn.Linear(4, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
            self.final_layer = nn.Linear(4, 4)
            self.caption_projection = nn.Linear(4, 4)   # registered last, runs first

        def forward(self, x):
            x = self.x_in(x) + self.caption_projection(x)
            for b in self.blocks:
                x = b(x)
            return self.final_layer(x)

    m = LateEmbedder()
    us = find_units(m)
    assert [u.name for u in us.units][-2:] == ["final_layer", "caption_projection"]
    assert_partition(m, us)
    from vramcut_core import Engine, EngineConfig
    eng = Engine(m, EngineConfig(budget_bytes=1 << 20, device="cpu"))
    with torch.no_grad():
        eng.run(m, torch.randn(2, 4))
    meas = eng.measurements[next(iter(eng.measurements))]
    assert list(meas)[:3] == ["prelude", "caption_projection", "blocks.0"]
    assert all(v.calls == 1 for v in meas.values())
