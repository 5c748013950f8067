"""The repository root is a ComfyUI package (it has an ``__init__.py``) but not a test package:
collect it as a plain directory, so pytest never imports the pack's entry point."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent


def pytest_collect_directory(path, parent):
    if pathlib.Path(path).resolve() == ROOT:
        return pytest.Dir.from_parent(parent, path=path)
    return None
