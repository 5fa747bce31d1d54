"""The layout search's window on the dry run (`lightning_dpar.layout.probe`): the model it prices is the one training
builds, the layers a LightningModule builds in `configure_model` included."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dpar.layout.probe import search_model
from lightning_dpar.layout.profiles import get_profile
from tests.support.hf_configs import decoder_config

CONTEXT = 128


class LlamaBuiltInConfigureModel(L.LightningModule):
    """A tiny transformers Llama built in `configure_model` (idempotently, as Lightning asks of the hook), as
    `examples/finetune/llama_module.py` builds its model: before that hook the module holds no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM(decoder_config(max_position_embeddings=CONTEXT))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def test_a_model_built_in_configure_model_is_searched_as_built():
    pytest.importorskip("transformers")
    module = LlamaBuiltInConfigureModel()
    result = search_model(module, 2, 1, get_profile("cpu-gloo"), batch_size=2)
    with torch.device("meta"):
        built = LlamaBuiltInConfigureModel()
        built.configure_model()
    # Before, the search read the empty module: 0 parameters, 1 layer, and no context length to default to.
    assert result.facts.params == sum(p.numel() for p in built.parameters()) > 0
    assert (result.facts.layers, result.facts.hidden, result.facts.seq_len) == (2, 32, CONTEXT)
    assert result.best is not None
    assert module.model is None  # the caller's module is left as it was: the search builds on its meta copy
