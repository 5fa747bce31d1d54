"""Every method of the package's strategies that overrides one of Lightning's carries `@override`: a Lightning
release renaming a hook then fails the type check instead of leaving our method silently uncalled."""

from __future__ import annotations

import inspect

import pytest
from lightning.pytorch.strategies import ParallelStrategy, Strategy

import lightning_dpar
from lightning_dpar.strategies.base import DparStrategy


def _package_classes() -> list[type]:
    """The strategy classes the package defines and every class of theirs it mixes in."""
    strategies = [DparStrategy, *(obj for obj in vars(lightning_dpar).values() if inspect.isclass(obj))]
    found: dict[type, None] = {}
    for strategy in strategies:
        if not issubclass(strategy, Strategy):
            continue
        for cls in strategy.__mro__:
            if cls.__module__.startswith("lightning_dpar") or cls.__module__.startswith("tests"):
                found[cls] = None
    return list(found)


def _lightning_names() -> set[str]:
    return {name for cls in ParallelStrategy.__mro__ if cls is not object for name in vars(cls)}


def _marked(attribute: object) -> bool:
    for function in (attribute, getattr(attribute, "fget", None), getattr(attribute, "__func__", None)):
        if function is not None and getattr(function, "__override__", False):
            return True
    return False


def missing_overrides() -> list[str]:
    """`module.Class.method` for each package method overriding a Lightning one without `@override`."""
    lightning = _lightning_names()
    missing = []
    for cls in _package_classes():
        for name, attribute in vars(cls).items():
            if name.startswith(("__", "_abc")) or name not in lightning:
                continue
            if not _marked(attribute):
                missing.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return sorted(missing)


def test_every_lightning_hook_override_is_marked():
    assert missing_overrides() == []


def test_an_unmarked_override_is_found():
    class Unmarked(DparStrategy):
        def barrier(self, name: str | None = None) -> None:  # overrides Lightning's without `@override`
            pass

    marked = {name: attr for name, attr in vars(DparStrategy).items() if _marked(attr)}
    assert "setup" in marked
    assert not _marked(vars(Unmarked)["barrier"])
    assert "barrier" in _lightning_names()


@pytest.mark.parametrize("name", ["setup_environment", "teardown"])
def test_the_base_strategy_hooks_are_marked(name):
    assert _marked(vars(DparStrategy)[name])
