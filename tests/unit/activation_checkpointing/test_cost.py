"""Activation checkpointing's pricing for the layout search: the recomputed FLOPs, the collectives run again, and
selective checkpointing's traced share of what full checkpointing recomputes."""

from __future__ import annotations

import pytest

from lightning_dpar.activation_checkpointing.cost import collective_passes, recompute_factor, selective_share
from lightning_dpar.activation_checkpointing.estimate import StepFlops


def test_full_checkpointing_recomputes_the_forward_and_selective_its_share_of_that():
    assert recompute_factor(False) == 1.0
    assert recompute_factor(True) == pytest.approx(8 / 6)
    assert recompute_factor("selective", 0.25) == pytest.approx(1 + 2 / 6 * 0.25)
    assert recompute_factor("selective", None) == recompute_factor(True)  # not traced: priced as full


def test_a_checkpointed_forward_runs_its_collectives_again():
    assert [collective_passes(c) for c in (False, True, "selective")] == [4, 6, 6]


def test_the_selective_share_is_read_off_the_traced_steps_flops():
    assert selective_share(StepFlops(plain=300, full=400, selective=325)) == 0.25
    assert selective_share(StepFlops(plain=300, full=300, selective=300)) is None  # nothing recomputed
    assert selective_share(None) is None
