"""Shared test set-up: the test helper modules (toys, tiny_models) import by name, and
``vramcut_core`` is imported from this checkout (not from whichever copy is installed)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(HERE, "core")):
    if p not in sys.path:
        sys.path.insert(0, p)
