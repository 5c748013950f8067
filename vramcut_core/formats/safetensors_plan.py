"""Plan a model from its safetensors header alone (no weights read).

Blocks are discovered from numbered key prefixes: ``double_blocks.7.img_attn.qkv.weight`` belongs
to unit ``double_blocks.7``; ``model.diffusion_model.input_blocks.4.1.proj.weight`` to
``model.diffusion_model.input_blocks.4``. For each key the outermost numbered list with at least
``MIN_BLOCKS`` entries is its block list (so ``conditioner.embedders.0`` is not taken for a block
list, but the encoder layers inside it are). Everything else goes to a prelude or final unit of its
component. Activations are not measured: the plan is a weight-only plan.

An all-in-one checkpoint (most SD1.5/SDXL files) holds the diffusion model, the text encoders and
the VAE under the prefixes ComfyUI's checkpoint loader reads them from; ``split_components`` cuts
its header into one header per component, so each is planned on its own under the budget, as the
Max VRAM node plans MODEL, CLIP and VAE.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import struct

from ..planning.plan import PlanUnit

MIN_BLOCKS = 3
_MAX_HEADER = 512 * 1024 * 1024
_FINAL_WORDS = ("final", "norm_out", "conv_out", "out.", "head", "proj_out", "norm.", "ln_f", "final_layer")

DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
               "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


class HeaderError(ValueError):
    """The file is not a readable safetensors file."""


def file_size(path: str, kind: str) -> int:
    """The size of the checkpoint file at ``path``; a ``HeaderError`` where there is none, or a
    directory instead of a ``kind`` ("safetensors", "GGUF") file."""
    if not os.path.exists(path):
        raise HeaderError(f"{path}: no such file")
    if os.path.isdir(path):
        raise HeaderError(f"{path}: is a directory, not a {kind} file")
    return os.path.getsize(path)


def read_header(path: str) -> dict:
    """The safetensors header: ``{key: {dtype, shape, data_offsets}}`` (metadata dropped)."""
    size = file_size(path, "safetensors")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n <= 0 or n > _MAX_HEADER or 8 + n > size:
            raise HeaderError(f"{path}: not a safetensors file (bad header length)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HeaderError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for k, v in header.items():
        try:
            a, b = v["data_offsets"]
            ok = 0 <= a <= b <= data and isinstance(v["dtype"], str)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise HeaderError(f"{path}: not a safetensors file (bad entry for {k!r})")
    return header


_NUM = re.compile(r"\.(\d+)(?=\.)")


def group_keys(keys) -> tuple[list[str], dict[str, str]]:
    """Unit names in order, and the unit of each key."""
    keys = list(keys)
    # distinct indices per list prefix
    counts: dict[str, set[int]] = collections.defaultdict(set)
    for k in keys:
        for m in _NUM.finditer(k):
            counts[k[: m.start()]].add(int(m.group(1)))
    unit_of: dict[str, str] = {}
    lists: dict[str, str] = {}  # unit -> its list prefix
    for k in keys:
        unit = None
        for m in _NUM.finditer(k):
            prefix = k[: m.start()]
            if len(counts[prefix]) >= MIN_BLOCKS:
                unit = k[: m.end()]
                lists[unit] = prefix
                break
        unit_of[k] = unit or ""
    # keys outside blocks: prelude / final of the component (the text before the first list)
    components: dict[str, int] = {}
    for k in keys:
        if unit_of[k]:
            comp = lists[unit_of[k]].rsplit(".", 1)[0] if "." in lists[unit_of[k]] else ""
            components.setdefault(comp, len(components))
    for k in keys:
        if unit_of[k]:
            continue
        comp = max((c for c in components if c and k.startswith(c + ".")), key=len, default="")
        rest = k[len(comp) + 1:] if comp else k
        where = "final" if any(w in rest for w in _FINAL_WORDS) else "prelude"
        unit_of[k] = f"{comp}.{where}" if comp else where

    list_rank: dict[str, int] = {}
    for u in lists:
        list_rank.setdefault(lists[u], len(list_rank))

    def sort_key(u: str):
        lst = lists.get(u)
        if lst is not None:
            return (list_rank[lst], 1, int(u.rsplit(".", 1)[1]))
        comp = u.rsplit(".", 1)[0] if "." in u else ""
        ranks = [r for p, r in list_rank.items() if not comp or p.startswith(comp + ".")]
        rank = (min(ranks) if u.endswith("prelude") else max(ranks)) if ranks else 0
        return (rank, 0 if u.endswith("prelude") else 2, 0)

    return sorted(set(unit_of.values()), key=sort_key), unit_of


def plan_units_from_header(header: dict) -> list[PlanUnit]:
    order, unit_of = group_keys(header)
    nbytes: dict[str, int] = collections.Counter()
    for k, v in header.items():
        a, b = v["data_offsets"]
        nbytes[unit_of[k]] += b - a
    return [PlanUnit(u, nbytes[u]) for u in order if nbytes[u] > 0]


# Where an all-in-one checkpoint keeps each model: the prefixes ComfyUI's checkpoint loader reads
# (``supported_models_base``: ``model.diffusion_model.``; text encoders ``cond_stage_model.``,
# SDXL's ``conditioner.embedders.``, newer families' ``text_encoders.``; VAE ``first_stage_model.``
# or ``vae.``). Named as the node's inputs are: each is planned as the node plans that input.
COMPONENTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("MODEL", "diffusion model", ("model.diffusion_model.",)),
    ("CLIP", "text encoders", ("cond_stage_model.", "conditioner.embedders.", "text_encoders.")),
    ("VAE", "VAE", ("first_stage_model.", "vae.")),
)


@dataclasses.dataclass(frozen=True)
class Component:
    """One model of a checkpoint: ``name`` is the node input it goes to ("MODEL", "CLIP", "VAE"),
    empty for a file that holds one model only; ``header`` holds its keys, unchanged."""

    name: str
    label: str
    prefixes: tuple[str, ...]
    header: dict


def split_components(header: dict) -> tuple[list[Component], dict]:
    """``(components, rest)``: the header cut per component, in the order MODEL, CLIP, VAE, and
    the keys that belong to none (``alphas_cumprod``, EMA copies: no node input loads them).

    A header with fewer than two components present is one model (a diffusion model, a text
    encoder or a VAE file, prefixed or not): it comes back whole, as one unnamed component."""
    parts: dict[str, dict] = {name: {} for name, _, _ in COMPONENTS}
    rest: dict = {}
    for k, v in header.items():
        for name, _, prefixes in COMPONENTS:
            if k.startswith(prefixes):
                parts[name][k] = v
                break
        else:
            rest[k] = v
    present = [(name, label, prefixes) for name, label, prefixes in COMPONENTS if parts[name]]
    if len(present) < 2:
        return [Component("", "", (), header)], {}
    return [Component(name, label, tuple(p for p in prefixes if any(k.startswith(p) for k in parts[name])),
                      parts[name]) for name, label, prefixes in present], rest


def header_bytes(header: dict) -> int:
    """Stored bytes of the tensors a header declares."""
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
