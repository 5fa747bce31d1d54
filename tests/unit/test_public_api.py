"""Each module of the package says what it offers (`__all__`), and the API reference renders the package's API."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import lightning_dpar

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "lightning_dpar").rglob("*.py")
)


@pytest.mark.parametrize("name", MODULES)
def test_every_module_declares_all_with_names_it_has(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} declares no __all__"
    assert [n for n in module.__all__ if not hasattr(module, n)] == []


def test_the_api_reference_renders_every_public_name_of_the_package():
    api = (ROOT / "docs" / "api.md").read_text()
    assert [n for n in lightning_dpar.__all__ if n != "__version__" and f"::: lightning_dpar.{n}\n" not in api] == []
