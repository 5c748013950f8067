"""Cut units: the blocks a model's forward is cut at.

A unit is one block of a block sequence (``double_blocks.7``), or the ``prelude`` of a model
component (everything registered before its blocks: embedders), or a final unit (each module
registered after the blocks, by its path: ``final_layer``, ``norm_out``), or
the ``shared`` unit (tensors that several units read: tied weights, parameters owned directly
by the containers that hold the block lists). Every parameter and buffer of the module belongs
to exactly one unit.

Which module lists are the block sequences comes from an architecture registry (`FAMILIES`);
a model no family matches gets the generic fallback, which finds long lists of same-typed
blocks. A model without any such list still gets units (prelude/final only), never a crash.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import torch
from torch import nn

from .tensors import tensor_nbytes

PRELUDE = "prelude"
SHARED = "shared"
GENERIC = "generic"


@dataclasses.dataclass(frozen=True)
class Family:
    """Where one model family keeps its block sequences.

    ``blocks`` are dotted module paths in execution order. A path ending in ``.*`` is a list
    whose children are the units; any other path is one unit. A path starting with ``?`` is
    optional. ``nested`` families (text encoders, VAEs) are searched anywhere in the tree: a
    path matches the end of a qualified module name.
    """

    name: str
    label: str
    blocks: tuple[str, ...]
    nested: bool = False
    requires: tuple[str, ...] = ()  # other submodules that must exist (tells apart look-alikes)
    classes: tuple[str, ...] = ()   # the root's class, its dotted name's end, is one of these (none: any)


FAMILIES: tuple[Family, ...] = (
    Family("unet", "UNet (SD1.x/SD2/SDXL)", ("input_blocks.*", "middle_block", "output_blocks.*")),
    Family("hidream", "HiDream", ("double_stream_blocks.*", "single_stream_blocks.*")),
    # Chroma Radiance: the Chroma blocks, then the pixel-space NeRF head's blocks.
    Family("chroma_radiance", "Chroma Radiance", ("double_blocks.*", "single_blocks.*", "nerf_blocks.*")),
    # Flux.1/Flux.2/LongCat, Chroma, HunyuanVideo 1.0/1.5 and HunyuanImage 2.1 (a build may
    # have no single blocks).
    Family("flux", "Flux/Chroma/HunyuanVideo", ("double_blocks.*", "?single_blocks.*")),
    Family("mmdit", "SD3 MMDiT", ("joint_blocks.*",)),
    Family("kandinsky5", "Kandinsky 5", ("text_transformer_blocks.*", "visual_transformer_blocks.*")),
    Family("omnigen2", "OmniGen2", ("noise_refiner.*", "?ref_image_refiner.*", "context_refiner.*", "layers.*"),
           requires=("ref_image_refiner",)),
    # Lumina2 and Z-Image (NextDiT; Z-Image Omni adds a SigLIP refiner).
    Family("lumina2", "Lumina2/Z-Image", ("noise_refiner.*", "context_refiner.*", "?siglip_refiner.*", "layers.*")),
    # LTX-Video and LTX-2: each LTX-2 block holds the video and the audio tower's layers of one
    # depth (they cross-attend), so cutting the block list cuts both towers.
    Family("ltxv", "LTX-Video/LTX-2", ("transformer_blocks.*",), requires=("patchify_proj", "adaln_single")),
    Family("cosmos", "Cosmos", ("blocks.*",), requires=("x_embedder", "pos_embedder")),
    Family("wan", "Wan", ("blocks.*", "?vace_blocks.*"), requires=("patch_embedding",)),
    Family("qwen_image", "Qwen-Image", ("transformer_blocks.*",), requires=("img_in", "txt_in")),
    Family("esrgan", "ESRGAN", ("model.1.sub.*",)),
    # The command line's own demo model (``python -m vramcut_core demo``), by class: its layout
    # (embed, blocks, norm, head) is too common to tell apart by names.
    Family("demo", "demo transformer", ("blocks.*",), classes=("vramcut_core.cli.demo.DemoTransformer",)),
    # Searched anywhere in the tree, so a multi-encoder CLIP (SD3: CLIP-L + CLIP-G + T5) gets
    # the layers of each encoder.
    Family("text_encoder", "text encoder", (
        "encoder.layers.*",       # CLIP text / CLIP vision
        "encoder.block.*",        # T5 / UMT5
        "model.layers.*",         # LLM encoders (Llama, Qwen2.5, Gemma)
        "visual.blocks.*",        # Qwen2.5-VL's vision tower (image inputs)
        "transformer.resblocks.*",
    ), nested=True),
    Family("sd_vae", "SD-style VAE", (
        "encoder.down.*", "encoder.mid", "decoder.mid", "decoder.up.*",
    ), nested=True),
    # The Wan video VAE runs its decoder once per latent frame (the planner keeps looped units
    # resident when they fit).
    Family("wan_vae", "Wan VAE", (
        "encoder.downsamples.*", "encoder.middle", "decoder.middle", "decoder.upsamples.*",
    ), nested=True),
)

# The generic fallback takes a module list as a block sequence when it has at least this many
# children and most of them share one type.
GENERIC_MIN_BLOCKS = 4
GENERIC_SAME_TYPE_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """One place a tensor is registered: ``owner._parameters[key]`` or ``owner._buffers[key]``."""

    owner: nn.Module
    key: str
    is_param: bool
    qualname: str

    def get(self) -> torch.Tensor | None:
        store = self.owner._parameters if self.is_param else self.owner._buffers
        return store.get(self.key)

    def set(self, value: torch.Tensor) -> None:
        store = self.owner._parameters if self.is_param else self.owner._buffers
        store[self.key] = value


@dataclasses.dataclass
class UnitTensor:
    """A tensor of a unit, with every place it is registered (tied weights have several)."""

    tensor: torch.Tensor
    refs: list[TensorRef]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.tensor)


@dataclasses.dataclass
class Unit:
    """One cut unit. ``roots`` are the modules whose call means "this unit runs"; ``hook_modules``
    are every module that reads the unit's tensors (the roots plus each module that owns one)."""

    name: str
    kind: str  # "block", "prelude", "final" or "shared"
    roots: list[tuple[str, nn.Module]]
    tensors: list[UnitTensor]
    keep_resident: bool = False  # must stay resident (shared tensors, tensors read outside a hook)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def hook_modules(self) -> list[nn.Module]:
        seen: dict[int, nn.Module] = {}
        for _, m in self.roots:
            seen.setdefault(id(m), m)
        for t in self.tensors:
            for r in t.refs:
                seen.setdefault(id(r.owner), r.owner)
        return list(seen.values())

    def __repr__(self) -> str:  # dataclass repr would print every tensor
        return f"Unit({self.name!r}, {self.kind}, {len(self.tensors)} tensors, {self.weight_bytes} B)"


@dataclasses.dataclass
class UnitSet:
    """The units of one module, in structural execution order."""

    units: list[Unit]
    family: str
    label: str
    warnings: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.by_name = {u.name: u for u in self.units}
        if len(self.by_name) != len(self.units):
            raise ValueError("unit names must be unique")

    @property
    def weight_bytes(self) -> int:
        return sum(u.weight_bytes for u in self.units)

    def __len__(self) -> int:
        return len(self.units)


# ----------------------------------------------------------------------------------------------
# Finding the block sequences


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def _children_of_list(m: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(k, c) for k, c in m.named_children() if c is not None]


def _has_tensors(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(True for _ in m.buffers())


def _expand(root: nn.Module, prefix: str, path: str) -> list[tuple[str, nn.Module]] | None:
    """The blocks that ``path`` names under ``prefix`` (None when the path is absent)."""
    many = path.endswith(".*")
    base = path[:-2] if many else path
    full = f"{prefix}.{base}" if prefix else base
    m = _resolve(root, full)
    if m is None:
        return None
    if not many:
        return [(full, m)]
    return [(f"{full}.{k}", c) for k, c in _children_of_list(m) if _has_tensors(c)]


def _match_root_family(root: nn.Module, families: tuple[Family, ...]
                       ) -> tuple[Family, list[tuple[str, nn.Module]]] | None:
    for fam in families:
        if fam.nested or any(_resolve(root, r) is None for r in fam.requires):
            continue
        cls = f"{type(root).__module__}.{type(root).__qualname__}"
        if fam.classes and not any(cls == c or cls.endswith("." + c) for c in fam.classes):
            continue
        blocks: list[tuple[str, nn.Module]] = []
        ok = True
        for path in fam.blocks:
            optional = path.startswith("?")
            found = _expand(root, "", path.lstrip("?"))
            if found is None or not found:
                if not optional:
                    ok = False
                    break
                continue
            blocks.extend(found)
        if ok and blocks:
            return fam, blocks
    return None


def _match_nested_families(root: nn.Module, families: tuple[Family, ...]
                           ) -> tuple[list[Family], list[tuple[str, nn.Module]]]:
    """Blocks of the nested families anywhere in the tree, outermost lists only."""
    fams: list[Family] = []
    blocks: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for qual, _ in root.named_modules():
        if any(qual == t or qual.startswith(t + ".") for t in taken):
            continue
        for fam in (f for f in families if f.nested):
            for path in fam.blocks:
                base = path[:-2] if path.endswith(".*") else path
                if not (qual == base or qual.endswith("." + base)):
                    continue
                prefix = qual[: len(qual) - len(base)].rstrip(".")
                found = _expand(root, prefix, path)
                if not found:
                    continue
                blocks.extend(found)
                taken.append(qual)
                if fam not in fams:
                    fams.append(fam)
    return fams, blocks


def _generic_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Long lists of same-typed blocks, outermost first: the fallback for unknown models."""
    blocks: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for qual, m in root.named_modules():
        if any(qual == t or qual.startswith(t + ".") for t in taken):
            continue
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [(k, c) for k, c in _children_of_list(m) if _has_tensors(c)]
        if len(kids) < GENERIC_MIN_BLOCKS:
            continue
        most = collections.Counter(type(c) for _, c in kids).most_common(1)[0][1]
        if most / len(kids) < GENERIC_SAME_TYPE_SHARE:
            continue
        blocks.extend((f"{qual}.{k}" if qual else k, c) for k, c in kids)
        taken.append(qual)
    return blocks


# ----------------------------------------------------------------------------------------------
# Assigning every tensor to one unit


def _direct_tensors(qual: str, m: nn.Module):
    for key, t in m._parameters.items():
        if t is not None:
            yield TensorRef(m, key, True, f"{qual}.{key}" if qual else key), t
    for key, t in m._buffers.items():
        if t is not None:
            yield TensorRef(m, key, False, f"{qual}.{key}" if qual else key), t


class _Claims:
    """Which units want each tensor; a tensor wanted by two units goes to ``shared``."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.tensor: dict[int, torch.Tensor] = {}
        self.refs: dict[int, list[TensorRef]] = collections.defaultdict(list)
        self.order: list[int] = []

    def claim(self, unit: str, ref: TensorRef, t: torch.Tensor) -> None:
        k = id(t)
        if k not in self.owner:
            self.owner[k] = unit
            self.tensor[k] = t
            self.order.append(k)
        elif self.owner[k] != unit:
            self.owner[k] = SHARED
        if not any(r.owner is ref.owner and r.key == ref.key for r in self.refs[k]):
            self.refs[k].append(ref)

    def claim_subtree(self, unit: str, qual: str, m: nn.Module) -> None:
        for sub_qual, sub in m.named_modules(prefix=qual, remove_duplicate=False):
            for ref, t in _direct_tensors(sub_qual, sub):
                self.claim(unit, ref, t)

    def tensors_of(self, unit: str) -> list[UnitTensor]:
        return [UnitTensor(self.tensor[k], self.refs[k]) for k in self.order if self.owner[k] == unit]


def _is_embedding(m: nn.Module) -> bool:
    return isinstance(m, nn.Embedding)


def _build(root: nn.Module, blocks: list[tuple[str, nn.Module]], family: str, label: str,
           warnings: list[str]) -> UnitSet:
    block_ids = {id(m) for _, m in blocks}
    block_quals = [q for q, _ in blocks]

    def contains_block(qual: str) -> bool:
        return any(b == qual or b.startswith(qual + ".") for b in block_quals) if qual else True

    claims = _Claims()
    leaves: dict[str, list[tuple[str, nn.Module]]] = collections.defaultdict(list)
    order: list[str] = []
    finals: set[str] = set()

    def visit(qual: str, m: nn.Module, component: str) -> None:
        # m contains blocks: its own tensors are read by its forward at any time -> shared.
        for ref, t in _direct_tensors(qual, m):
            claims.claim(SHARED, ref, t)
        seen_block = False
        for key, child in m.named_children():
            if child is None:
                continue
            cq = f"{qual}.{key}" if qual else key
            if id(child) in block_ids:
                seen_block = True
                continue
            if contains_block(cq):
                seen_block = True
                visit(cq, child, component or (key if not qual else component))
                continue
            if not _has_tensors(child):
                continue
            if not seen_block or _is_embedding(child):
                name = f"{component}.{PRELUDE}" if component else PRELUDE
            else:
                # Registered after a block list: usually the output layers, but some models
                # register embedders there (HiDream's caption projection, Lumina2's t/cap
                # embedders). Each gets a unit of its own, so the measured order places it.
                name = cq
                finals.add(name)
            if name not in leaves:
                order.append(name)
            leaves[name].append((cq, child))

    # Blocks claim first so that a module registered both inside a block and outside it is
    # recognised as shared.
    for qual, m in blocks:
        claims.claim_subtree(qual, qual, m)
    visit("", root, "")
    for name in order:
        for cq, child in leaves[name]:
            claims.claim_subtree(name, cq, child)

    units: list[Unit] = []
    for name in (n for n in order if n not in finals):
        units.append(Unit(name, "prelude", leaves[name], claims.tensors_of(name)))
    for qual, m in blocks:
        units.append(Unit(qual, "block", [(qual, m)], claims.tensors_of(qual)))
    for name in (n for n in order if n in finals):
        units.append(Unit(name, "final", leaves[name], claims.tensors_of(name)))
    shared = claims.tensors_of(SHARED)
    if shared:
        units.insert(0, Unit(SHARED, "shared", [], shared, keep_resident=True))
    units = [u for u in units if u.tensors]
    return UnitSet(units, family, label, warnings)


def find_units(module: nn.Module, family: str | None = None) -> UnitSet:
    """The cut units of ``module``.

    ``family`` forces a registry entry by name (``"flux"``, ``"text_encoder"``, ...);
    by default the registry is tried in order, then the generic fallback.
    """
    if family is not None and family not in {f.name for f in FAMILIES} | {GENERIC}:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(f.name for f in FAMILIES)}, {GENERIC}")
    warnings: list[str] = []
    if family != GENERIC:
        wanted = tuple(f for f in FAMILIES if family is None or f.name == family)
        hit = _match_root_family(module, wanted)
        if hit is not None:
            fam, blocks = hit
            return _build(module, blocks, fam.name, fam.label, warnings)
        fams, blocks = _match_nested_families(module, wanted)
        if blocks:
            name = "+".join(f.name for f in fams)
            label = " + ".join(f.label for f in fams)
            return _build(module, blocks, name, label, warnings)
    blocks = _generic_blocks(module)
    cls = type(module).__name__
    if blocks:
        warnings.append(f"{cls}: no known family; generic fallback found {len(blocks)} blocks")
    else:
        warnings.append(f"{cls}: no block sequence found; the model runs as prelude/final units only")
    return _build(module, blocks, GENERIC, f"generic ({cls})", warnings)


def split_unit(unit: Unit) -> list[Unit] | None:
    """Cut a unit finer: one sub-unit per root when it has several, else one per child module
    of its single root. Tensors the root owns directly (read by its own forward at any time)
    become a ``<name>.self`` sub-unit kept resident. Returns None when the unit cannot be cut finer."""
    if unit.kind == "shared" or not unit.roots:
        return None
    mine = {id(t.tensor) for t in unit.tensors}
    if len(unit.roots) > 1:
        parts = [(q, [(q, m)]) for q, m in unit.roots]
        direct: list[UnitTensor] = []
    else:
        qual, root = unit.roots[0]
        while True:
            parts = [(f"{qual}.{k}", [(f"{qual}.{k}", c)]) for k, c in root.named_children()
                     if c is not None and _has_tensors(c)]
            if len(parts) != 1 or any(True for _ in _direct_tensors(qual, root)):
                break
            # one child holds every tensor (a down block whose only child is its ModuleList of
            # blocks): cut that child instead
            qual, root = parts[0][1][0]
        if not parts:
            return None
        direct_ids = {id(t) for _, t in _direct_tensors(qual, root)}
        direct = [t for t in unit.tensors if id(t.tensor) in direct_ids]
    claims = _Claims()
    for name, roots in parts:
        for q, m in roots:
            claims.claim_subtree(name, q, m)
    subs: list[Unit] = []
    if direct:
        subs.append(Unit(f"{unit.name}.self", unit.kind, [], direct, keep_resident=True))
    for name, roots in parts:
        tensors = [t for t in claims.tensors_of(name) if id(t.tensor) in mine]
        if tensors:
            subs.append(Unit(name, unit.kind, roots, tensors))
    shared = [t for t in claims.tensors_of(SHARED) if id(t.tensor) in mine]
    if shared:  # a module used by two children of the block: keep it with the block's own tensors
        subs.insert(0, Unit(f"{unit.name}.shared", unit.kind, [], shared, keep_resident=True))
    if len(subs) < 2:
        return None
    return subs

