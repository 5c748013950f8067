"""The host surface (``nodes/host_surface.py``) against the ComfyUI these tests run on: one test
per listed name, so a host change fails the test named after what changed.

On a release the list describes (its ``hosts``), presence must be exactly as listed, guarded
names included; on any other release only what the adapter uses unguarded must be there.
Parameters the adapter passes must be accepted by the host's signatures."""
from __future__ import annotations

import importlib
import inspect
import os
import re

import pytest
import torch

import host_surface_lib as hs
import tiny_models as tm

SURFACE = hs.load_surface().SURFACE
KNOWN = ("0.3.64", "0.33.0")


@pytest.fixture(scope="module")
def host(comfy):
    path = tm.comfyui_path()
    with open(os.path.join(path, "comfyui_version.py"), encoding="utf-8") as f:
        version = re.search(r'__version__\s*=\s*"([^"]+)"', f.read()).group(1)
    return {"path": path, "version": version, "sources": None}


def _sources(host) -> str:
    if host["sources"] is None:
        texts = []
        for sub in ("comfy", "comfy_api", "comfy_execution"):
            for d, _, files in os.walk(os.path.join(host["path"], sub)):
                texts += [open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
                          for f in files if f.endswith(".py")]
        texts += [open(os.path.join(host["path"], f), encoding="utf-8").read() for f in ("server.py", "main.py")]
        host["sources"] = "\n".join(texts)
    return host["sources"]


def _resolve(name: str):
    """The object a dotted name means: modules imported as far as they go, then attributes;
    ``Class()`` builds a small instance (a ModelPatcher around a Linear on the CPU)."""
    parts = name.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        raise AttributeError(name)
    for p in parts[i:]:
        if p.endswith("()"):
            cls = getattr(obj, p[:-2])
            obj = cls(torch.nn.Linear(2, 2), load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
        else:
            obj = getattr(obj, p)
    return obj


def _present(use, host) -> bool:
    if use.kind == "source":
        return re.search(use.pattern or rf"\b{re.escape(use.name)}\b", _sources(host)) is not None
    try:
        _resolve(use.name)
        return True
    except AttributeError:
        return False


@pytest.mark.parametrize("use", SURFACE, ids=[u.name for u in SURFACE])
def test_host_surface(host, use):
    present = _present(use, host)
    if host["version"] in KNOWN:
        claimed = host["version"] in use.hosts
        assert present == claimed, (f"{use.name} is {'present' if present else 'absent'} on ComfyUI "
                                    f"{host['version']}; the list says {use.hosts!r}")
    elif use.need == "always":
        assert present, f"ComfyUI {host['version']} lacks {use.name}, which the adapter uses unguarded"
    if not present or not use.params:
        return
    obj = _resolve(use.name)
    sig = inspect.signature(obj)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    missing = [p for p in use.params if p not in sig.parameters]
    assert not missing, f"{use.name}{sig} no longer takes {missing}"
    if use.kind == "callable":
        assert callable(obj)


def test_cloning_a_patcher_calls_its_attachments_clone_hook(comfy):
    """``PatchState`` is shared by a patcher's clones through this hook (ModelPatcher.clone)."""
    import comfy.model_patcher

    class Attachment:
        cloned = 0

        def on_model_patcher_clone(self):
            Attachment.cloned += 1
            return self

    p = _resolve("comfy.model_patcher.ModelPatcher()")
    p.attachments["vramcut-test"] = a = Attachment()
    sub = type("Sub", (comfy.model_patcher.ModelPatcher,), {})
    p.__class__ = sub
    c = p.clone()
    assert Attachment.cloned == 1 and c.attachments["vramcut-test"] is a
    assert type(c) is sub  # clone() keeps the subclass
