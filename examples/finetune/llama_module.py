"""The LightningModule of the fine-tuning example: a Hugging Face causal LM, held as `self.model`, trained on byte
sequences (token ids 0-255).

It builds the model from the pretrained directory's `config.json` only, on the meta device (`configure_model`): the
strategy applies the model's own tensor-parallel plan (`tp_plan: auto`), shards it, materialises each rank's shards
with the model's own initialiser, and its `pretrained` argument then reads each rank's slices straight from the
safetensors files. No rank ever holds the whole model.
"""

from __future__ import annotations

import lightning as L
import torch
from transformers import AutoConfig, AutoModelForCausalLM


class LlamaFineTune(L.LightningModule):
    """Next-byte prediction with a pretrained causal LM.

    Args:
        pretrained: the `save_pretrained` directory whose `config.json` describes the model.
        learning_rate: AdamW's learning rate (fine-tuning scale).
    """

    def __init__(self, pretrained: str, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:  # once: `validate` after `fit` reuses the parallelised model
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.pretrained))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # The model shifts the labels itself. `use_cache=False`: training needs no key/value cache, and under
        # activation checkpointing the recomputed forward would append to the one the first forward filled (DeepSeek-V3
        # then fails in backward: its recomputed keys are twice as long; others keep every layer's keys for the step).
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch, use_cache=False).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
