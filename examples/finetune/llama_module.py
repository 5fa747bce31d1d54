"""The LightningModule of the fine-tuning example: a Hugging Face causal LM, held as `self.model`, trained on byte
sequences (token ids 0-255).

It builds the model from the pretrained directory's `config.json` only: the weights come from the strategy's
`pretrained` argument, which reads each rank's shards straight from the safetensors files once the model is
parallelised. Building the model here costs one copy of its (random) values per rank; `trainer.init_module
(empty_init=True)` avoids that where the strategy can materialise every module of the model on the meta device.
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
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss  # the model shifts the labels itself
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
