"""Read a ``.gguf`` file's header (metadata and tensor table) without loading any tensor.

GGUF (the llama.cpp / ComfyUI-GGUF format): ``GGUF`` magic, version, tensor and key-value
counts, the key-value pairs, then one entry per tensor (name, dims innermost first, GGML type,
offset into the data section), then the data section at the next multiple of
``general.alignment`` (32 by default). A tensor's stored size follows from its type's block
layout: ``elements / block_elements * block_bytes``.

``read_gguf_header`` returns the same shape of dict as ``safetensors_plan.read_header``
(``{name: {dtype, shape, data_offsets}}``), so the header planner groups and plans both alike.
"""
from __future__ import annotations

import struct

from .safetensors_plan import HeaderError, file_size

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGML type id -> (name, elements per block, bytes per block); as in ggml's type traits.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}

# key-value types: id -> struct format (scalars); 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24   # entries in one table or array: more means a damaged file


class _Reader:
    def __init__(self, f, path: str, size: int) -> None:
        self.f, self.path, self.size = f, path, size

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise HeaderError(f"{self.path}: not a GGUF file (header ends early)")
        return b

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.read(struct.calcsize(fmt)))[0]

    def count(self) -> int:
        n = self.scalar("Q")
        if n > _MAX_COUNT:
            raise HeaderError(f"{self.path}: not a GGUF file (count {n} is implausible)")
        return n

    def string(self) -> str:
        n = self.scalar("Q")
        if n > self.size:
            raise HeaderError(f"{self.path}: not a GGUF file (bad string length)")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("I"), self.count()
            return [self.value(itype) for _ in range(n)]
        raise HeaderError(f"{self.path}: not a GGUF file (unknown value type {vtype})")


def read_gguf(path: str) -> tuple[dict, dict]:
    """``(metadata, tensors)``: the key-value pairs, and ``{name: {dtype, shape, data_offsets}}``
    with offsets relative to the data section (shape outermost first, as torch has it)."""
    size = file_size(path, "GGUF")
    with open(path, "rb") as f:
        r = _Reader(f, path, size)
        if f.read(4) != MAGIC:
            raise HeaderError(f"{path}: not a GGUF file (no GGUF magic)")
        version = r.scalar("I")
        if version not in (2, 3):
            raise HeaderError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = r.count(), r.count()
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("I")
            if n_dims > 8:
                raise HeaderError(f"{path}: not a GGUF file ({name!r} has {n_dims} dims)")
            dims = [r.scalar("Q") for _ in range(n_dims)]
            ttype, offset = r.scalar("I"), r.scalar("Q")
            infos.append((name, dims, ttype, offset))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0:
            raise HeaderError(f"{path}: bad general.alignment {align!r}")
        data_start = (f.tell() + align - 1) // align * align
    data = size - data_start
    tensors = {}
    for name, dims, ttype, offset in infos:
        if ttype not in GGML_TYPES:
            raise HeaderError(f"{path}: {name!r} has GGML type {ttype}, which this reader does not know")
        tname, block, nbytes = GGML_TYPES[ttype]
        n = 1
        for d in dims:
            n *= d
        if n % block:
            raise HeaderError(f"{path}: {name!r}: {n} elements is not a whole number of {tname} blocks")
        end = offset + n // block * nbytes
        if end > data:
            raise HeaderError(f"{path}: {name!r} lies beyond the end of the file (truncated?)")
        tensors[name] = {"dtype": tname, "shape": list(reversed(dims)), "data_offsets": [offset, end]}
    return meta, tensors


def read_gguf_header(path: str) -> dict:
    """The tensor table only, shaped like a safetensors header."""
    return read_gguf(path)[1]


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False
