"""`lightning_dpar.activation_checkpointing.estimate`: which traced figure each checkpointing setting stands for,
what checkpointed layers keep in the activation formula, and the FLOPs each setting recomputes. The traces
themselves: `tests/unit/estimates/test_activations.py`."""

from __future__ import annotations

from lightning_dpar.activation_checkpointing.estimate import (
    CHECKPOINTING_NAMES,
    StepFlops,
    checkpointed_layers,
    figure_of,
)
from lightning_dpar.activation_checkpointing.step import CHECKPOINTING_SETTINGS


def test_each_setting_picks_its_figure_and_an_untraced_selective_one_falls_back_on_full():
    assert [figure_of(setting, "none", "full", "selective") for setting in CHECKPOINTING_SETTINGS] == [
        "none",
        "selective",
        "full",
    ]
    assert figure_of("selective", "none", "full", None) == "full"


def test_checkpointed_layers_keep_their_input_and_recompute_one_layer_at_a_time():
    # 4 layers of 100 bytes, whose input is 10: checkpointed, they keep 4 x 10 and one layer is recomputed.
    assert checkpointed_layers(True, 4, 10, 100.0) == (40, 100.0)
    assert checkpointed_layers(False, 4, 10, 100.0) == (400.0, 0)


def test_recomputed_flops_are_the_difference_with_the_step_without_checkpointing():
    flops = StepFlops(plain=300, full=400, selective=320)
    assert [flops.recomputed(setting) for setting in CHECKPOINTING_SETTINGS] == [0, 20, 100]
    assert flops.recomputed_fraction(True) == 100 / 300
    assert StepFlops(0, 0, 0).recomputed_fraction(True) == 0.0


def test_every_setting_has_a_name_in_the_report():
    assert set(CHECKPOINTING_NAMES) == set(CHECKPOINTING_SETTINGS)
    assert CHECKPOINTING_NAMES["selective"] == "selective activation checkpointing"
