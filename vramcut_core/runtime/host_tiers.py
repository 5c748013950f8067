"""Host tiers at run time: which units' host copies are flat masters in RAM and which are read
from a file each call, under the plan's ``tiers.Tiers``.

Owns each disk-tier unit's reads (``(offset in its layout, file, offset in the file, bytes)``:
``disk.locate`` for tensors mapped from a checkpoint, the model's ``disk.CacheFile`` for the
others), the identity each tensor had when its bytes were found in the file (its storage
address and version counter: a write in place makes the file stale for it) and the count of
host bytes the pack holds. A unit moving to disk drops its flat master and its tensors are
mapped from the file again (no RAM of its own); a unit moving to RAM gets its master from
``host_memory.HostMasters`` when it is first copied. The one rule: a read is made only after
``check`` has found every file as it was, and from a file whose bytes are the tensors'.

What the move cost is measured as it happens (``LoadCost``, ``load_json``): the bytes found in
the checkpoint the host's loader mapped (no copy in RAM), the bytes its loader held in anonymous
memory (read in, or cast on load) and the time their cache file took to write, and how much the
process's anonymous memory fell while the units left RAM (``RssAnon``: what the host's load had
held beyond the budget, now released, unless something else still holds it).
May call torch, ``quant``, ``layout``, ``disk`` and ``host_memory``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from ..figures import bandwidth
from ..model import quant
from ..model.units import Unit
from ..planning.tiers import RAM, HostUnit, Tiers, bounce_for
from . import disk, host_memory
from .layout import Layout, view


def _tensors(unit: Unit, lay: Layout) -> list[tuple[int, torch.Tensor]]:
    """(offset in the layout, host tensor) of every flat tensor and quantized part, by offset."""
    out = [(off, unit.tensors[i].tensor) for i, off, _ in lay.flat]
    out += [(off, p) for i, spans in lay.quant.items()
            for (off, _), p in zip(spans, quant.parts(unit.tensors[i].tensor))]
    return sorted(out, key=lambda x: x[0])


def _version(t: torch.Tensor) -> int | None:
    """A tensor's version counter; None for an inference tensor (a host that loaded its weights
    under inference mode: ComfyUI's VAE), which keeps none. Such a tensor can be written in place
    only inside inference mode, and a write there is not seen: its address still is."""
    try:
        return t._version
    except RuntimeError:  # (a parameter holding inference data says is_inference() False)
        return None


def anonymous_bytes() -> int | None:
    """The process's anonymous resident memory (``RssAnon`` of ``/proc/self/status``); None where
    the system does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclasses.dataclass
class LoadCost:
    """What moving the units out of RAM cost, measured (summed over every move)."""

    cached_bytes: int = 0             # in anonymous memory as the host loaded them: written to the cache file
    write_s: float = 0.0              # writing them
    move_s: float = 0.0               # the whole move (finding the files, writing, mapping)
    released_bytes: int | None = None  # the fall of the process's anonymous memory (None: not measurable)


class HostTiers:
    """One executor's units under the plan's tiers (inactive without a RAM budget)."""

    def __init__(self, units: Callable[[str], Unit], layout: Callable[[str], Layout], masters) -> None:
        self._unit, self._layout, self._masters = units, layout, masters
        self.tiers: Tiers | None = None
        self._reads: dict[str, list[tuple[int, disk.WeightFile, int, int]]] = {}
        self._seen: dict[str, tuple] = {}       # unit -> (addresses, versions) when its reads were made
        self._cache: disk.CacheFile | None = None
        self._rate: tuple[float | None] | None = None
        self.load = LoadCost()

    def host_unit(self, name: str) -> HostUnit:
        lay = self._layout(name)
        read = sum(n for _, _, n in lay.flat) + sum(n for sp in lay.quant.values() for _, n in sp)
        return HostUnit(lay.nbytes, read, fileable=not lay.other and lay.nbytes > 0)

    def bounce_bytes(self, host: dict[str, HostUnit]) -> int:
        """The bounce buffer a read from disk needs with these units (CUDA; 0 on CPU, where reads
        go straight into the slot)."""
        if not self._masters.cuda:
            return 0
        return bounce_for(host, host_memory.BOUNCE_PIECE, host_memory.BOUNCE_PIECES)

    def of(self, name: str) -> str | None:
        """Where unit ``name``'s host copy is (``Tiers.host_tier``: a resident unit held in RAM is
        RAM); None without a RAM budget."""
        return self.tiers.host_tier(name) if self.tiers is not None else None

    def in_ram(self, name: str) -> bool:
        """Is unit ``name``'s host copy a flat master in RAM under the tiers (a resident unit
        ``held`` included)?"""
        return self.of(name) == RAM

    def reads(self, name: str) -> list[tuple[int, disk.WeightFile, int, int]] | None:
        """The reads that fill unit ``name``'s layout from its files; None unless it is on disk
        (or resident, read once) under the tiers."""
        if self.tiers is None or self.of(name) in (None, RAM) or not self.host_unit(name).fileable:
            return None
        self._to_disk(name)
        return self._reads[name]

    def use(self, tiers: Tiers | None) -> None:
        """Apply ``tiers``: every unit whose host copy is not in RAM leaves its master and is mapped
        from its file (first, so that RAM is freed before the new masters are made), then the
        RAM units' masters are made."""
        self.tiers = tiers
        if tiers is None:
            return
        moving = [n for n, _ in tiers.tier if tiers.host_tier(n) != RAM and self.host_unit(n).fileable
                  and not self._made(n)]
        if moving:
            before, t0 = anonymous_bytes(), time.perf_counter()
            for name in moving:
                self._to_disk(name)
            after = anonymous_bytes()
            self.load.move_s += time.perf_counter() - t0
            if before is not None and after is not None:
                self.load.released_bytes = (self.load.released_bytes or 0) + max(0, before - after)
        for name, _ in tiers.tier:  # the masters, made here (outside any forward's meter)
            if tiers.host_tier(name) == RAM:
                self._masters.get(name)

    def _state(self, name: str) -> tuple:
        ts = _tensors(self._unit(name), self._layout(name))
        return tuple(t.data_ptr() for _, t in ts), tuple(_version(t) for _, t in ts)

    def _made(self, name: str) -> bool:
        return name in self._reads and self._seen.get(name) == self._state(name)

    def _to_disk(self, name: str) -> None:
        """Make unit ``name``'s reads (once, and again where its tensors moved or were written)."""
        if self._made(name):
            return
        m = self._masters.masters.pop(name, None)
        if m is not None:
            m.release()  # unpinned after the copies that read it; freed once the tensors leave it
        unit, lay = self._unit(name), self._layout(name)
        ts = _tensors(unit, lay)
        sizes = {off: t.numel() * t.element_size() for off, t in ts}
        locs = disk.locate([t for _, t in ts])
        old = {(d, n): (f, fo) for d, f, fo, n in self._reads.get(name, ())}
        reads, homes = [], {}
        missing = []
        for (off, t), loc in zip(ts, locs):
            n = sizes[off]
            if loc is not None:
                reads.append((off, disk.weight_file(loc[0]), loc[1], n))
            elif (off, n) in old and self._seen.get(name, ((), ()))[1] == self._state(name)[1]:
                f, fo = old[(off, n)]  # in a master since: the file still holds its bytes
                f.check()
                reads.append((off, f, fo, n))
                homes[off] = disk.mapped(f.path, fo, n)
            else:
                missing.append((off, t))
        if missing:
            if self._cache is None:
                self._cache = disk.CacheFile()
            chunks = [t.detach().reshape(-1).view(torch.uint8) for _, t in missing]
            t0 = time.perf_counter()
            base = self._cache.append(chunks)
            self.load.write_s += time.perf_counter() - t0
            self.load.cached_bytes += sum(sizes[off] for off, _ in missing)
            f = disk.weight_file(self._cache.path)
            pos = base
            for off, t in missing:
                n = sizes[off]
                reads.append((off, f, pos, n))
                homes[off] = (f.path, pos, n)
                pos += n
            f.grown()
            for off in list(homes):
                if isinstance(homes[off], tuple):
                    homes[off] = disk.mapped(*homes[off])
        if homes:
            self._rebind(unit, lay, homes)
        self._reads[name] = sorted(reads, key=lambda r: r[0])
        self._seen[name] = self._state(name)

    def _rebind(self, unit: Unit, lay: Layout, homes: dict[int, torch.Tensor]) -> None:
        """Point the tensors at ``homes`` (layout offset -> their bytes on a file mapping)."""
        with torch.inference_mode(False):
            for i, off, n in lay.flat:
                if off in homes:
                    t = unit.tensors[i].tensor
                    t.data = view(homes[off], 0, n, t)
            for i, spans in lay.quant.items():
                if any(off in homes for off, _ in spans):
                    t = unit.tensors[i].tensor
                    views = [view(homes[off], 0, n, p) if off in homes else p
                             for (off, n), p in zip(spans, quant.parts(t))]
                    quant.rehome_(t, views)

    def disk_rate(self, names: list[str]) -> float | None:
        """Cold reads per second of the disk the model's weights are read from (``bandwidth``'s
        cached figure, measured once on the first file of units ``names``); None where no file
        holds them yet."""
        if self._rate is None:
            for name in names:
                lay = self._layout(name)
                ts = _tensors(self._unit(name), lay)[:1]
                loc = disk.locate([t for _, t in ts])[0] if ts else None
                if loc is not None:
                    self._rate = (bandwidth.disk_read(loc[0])["cold_bytes_per_s"],)
                    break
            else:
                return None
        return self._rate[0]

    def check(self) -> None:
        """Before a call: every file read from is as it was (``disk.DiskTierError`` naming it
        otherwise), and units whose tensors were written or moved since get their reads again."""
        if self.tiers is None:
            return
        files = {}
        for name in self.tiers.disk_units:
            for _, f, _, _ in self._reads.get(name, ()):
                files[f.path] = f
        for f in files.values():
            f.check()
        for name in self.tiers.disk_units:
            if name in self._reads and self._seen.get(name) != self._state(name):
                self._to_disk(name)

    def host_bytes(self) -> int:
        """Host bytes the pack holds for this executor's units: flat masters and the bounce buffer."""
        b = sum(m.buf.numel() for m in self._masters.masters.values())
        bounce = self._masters._bounce
        return b + (bounce.nbytes if bounce is not None else 0)

    def load_json(self) -> dict | None:
        """What the host holds and what the move out of RAM cost, measured (None before the tiers
        were applied): ``mapped_bytes`` read from the checkpoint the host mapped (never copied in
        RAM), ``cached_bytes`` the host's loader held in anonymous memory (written to the cache
        file in ``write_s``), ``released_bytes`` the fall of the process's anonymous memory while
        they left RAM, ``move_s``; and held now: ``ram_bytes`` of flat masters,
        ``page_locked_bytes`` of them page-locked, ``bounce_bytes``."""
        if self.tiers is None or not self._reads:
            return None
        cache = self._cache.path if self._cache is not None else None
        masters = list(self._masters.masters.values())
        bounce = self._masters._bounce
        return {**dataclasses.asdict(self.load),
                "mapped_bytes": sum(n for rs in self._reads.values() for _, f, _, n in rs if f.path != cache),
                "cache_file_bytes": self.cache_bytes,
                "ram_bytes": sum(m.buf.numel() for m in masters),
                "page_locked_bytes": sum(m.buf.numel() for m in masters if m.page_locked),
                "bounce_bytes": bounce.nbytes if bounce is not None else 0}

    @property
    def cache_bytes(self) -> int:
        return self._cache.size if self._cache is not None else 0

    def files(self) -> list[str]:
        return sorted({f.path for rs in self._reads.values() for _, f, _, _ in rs})

    def forget(self) -> None:
        self._reads.clear()
        self._seen.clear()
