"""Shared test set-up: the test helper modules (toys, tiny_models) import by name."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.join(HERE, "core")):
    if p not in sys.path:
        sys.path.insert(0, p)
