"""Activations counted on meta tensors: what one `training_step` saves for backward, split by block, and its scaling
to a layout (microbatch, pipeline stage, tensor parallelism, checkpointing)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dpar.examples import GPT
from lightning_dpar.layout.saved_activations import SavedActivations, measure_saved


def test_the_gpt_saves_about_17_hidden_states_per_block_and_the_count_scales_with_the_batch():
    with torch.device("meta"):
        gpt = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
    saved = measure_saved(gpt, batch_size=2, seq_len=64, vocab=256)
    assert saved is not None and saved.blocks == pytest.approx(4 * saved.largest_block)
    hidden_state = 2 * 64 * 64 * 4  # one (batch, seq, width) fp32 tensor
    assert 17 * hidden_state <= saved.largest_block <= 34 * hidden_state  # at least the formula's 17
    assert saved.rest > 0  # embeddings, head and loss
    double = measure_saved(gpt, batch_size=4, seq_len=64, vocab=256)
    assert double is not None and double.blocks == 2 * saved.blocks
    assert all(p.is_meta for p in gpt.parameters())


def test_a_step_that_cannot_run_on_meta_token_ids_falls_back_to_none():
    class FloatInputs(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

        def training_step(self, batch, batch_idx):
            return self.layers[0](batch).sum()  # token ids (long) into a Linear: fails

    with torch.device("meta"):
        module = FloatInputs()
    assert measure_saved(module, 2, 8, 16) is None


def test_scaling_to_a_layout():
    saved = SavedActivations(batch_size=8, largest_block=1000, blocks=4000, rest=500)
    shape = dict(layers=4, hidden=2, seq_len=3, element_size=4)
    assert saved.per_rank(microbatch_size=8, **shape) == 4000 + 500
    assert saved.per_rank(microbatch_size=4, **shape) == 2000 + 250
    # Tensor parallel 2: blocks keep (5 + 6) / 17 of their activations.
    assert saved.per_rank(microbatch_size=8, tensor_parallel=2, **shape) == int(4000 * 11 / 17 + 500)
    # Checkpointing: each block's input (s*b*h*e = 3*8*2*4) plus one block recomputed.
    assert saved.per_rank(microbatch_size=8, checkpointing=True, **shape) == 4 * 192 + 1000 + 500
    # 1F1B on 2 stages, 4 microbatches of 2: 2 in flight of 2 blocks each.
    piped = saved.per_rank(microbatch_size=2, pipeline=2, microbatches=4, schedule="1F1B", **shape)
    assert piped == int(2 * 2 * 1000 * 2 / 8 + 500 * 2 / 8)
