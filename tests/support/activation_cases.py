"""The runs behind the activation-estimate checks: the example GPT and a tiny transformers Llama trained for a few steps
through a real Trainer with a meter (`tests.support.activation_meter`) on one step, and the estimate that
`lightning_dpar.estimates.activations.estimate_activations` gives for the same model, layout and batch, computed from
the model built again on the meta device (as the `plan` dry run does). Shared by
`tests/unit/estimates/test_activations.py` (one rank) and `tests/workers/activations.py` (tensor parallel on two ranks).

Sizes: activations dominate (a batch of 8 x 128 tokens against models of 0.1-0.2M parameters), so the comparison is
not drowned in anything else; the parameters are not counted by either side anyway.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_dpar.estimates.activations import estimate_activations
from lightning_dpar.examples.gpt import GPT

BATCH, TOKENS, VOCAB = 8, 128, 256


def gpt() -> GPT:
    return GPT(vocab_size=VOCAB, block_size=TOKENS, n_layer=2, n_head=4, n_embd=64)


def gpt_moe() -> GPT:
    """The example's MoE variant, 4 experts, top-2 (traced as its dense equivalent)."""
    return GPT(vocab_size=VOCAB, block_size=TOKENS, n_layer=2, n_head=4, n_embd=64, n_experts=4)


class TinyQwen3MoE(L.LightningModule):
    """A 2-layer Qwen3-MoE (4 experts of width 64, top-2), trained by the model's own loss."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen3MoeForCausalLM

        from tests.support import moe

        config = moe.config(
            "qwen3_moe", vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=64, max_position_embeddings=TOKENS
        )
        self.model = Qwen3MoeForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TinyLlama(L.LightningModule):
    """A 2-layer Llama (grouped-query attention, 4 query and 2 key/value heads), trained on next-token prediction by
    the model's own loss, as `examples/finetune/llama_module.py` does."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        from tests.support.hf_configs import decoder_config

        sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128)
        self.model = LlamaForCausalLM(decoder_config(max_position_embeddings=TOKENS, **sizes))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


#: name -> (builder, the batch shape `training_step` receives: GPT reads `TOKENS + 1` and predicts the last `TOKENS`)
MODELS = {
    "gpt": (gpt, (BATCH, TOKENS + 1)),
    "llama": (TinyLlama, (BATCH, TOKENS)),
    "gpt_moe": (gpt_moe, (BATCH, TOKENS + 1)),
    "qwen3_moe": (TinyQwen3MoE, (BATCH, TOKENS)),
}


def _trainer(strategy, meter: L.Callback, devices: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        callbacks=[meter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def estimate_and_measure(model: str, strategy, meter, devices: int = 1) -> dict[str, dict[str, int]]:
    """Train `model` for 3 steps under `strategy` with `meter` on step 1; estimate the same layout. Both as
    `{"retained": bytes, "peak": bytes}` per microbatch on this rank."""
    build, shape = MODELS[model]
    torch.manual_seed(0)
    module = build()
    data = torch.randint(0, VOCAB, (4 * shape[0], shape[1]), generator=torch.Generator().manual_seed(0))
    trainer = _trainer(strategy, meter, devices)
    trainer.fit(module, DataLoader(data, batch_size=shape[0]))
    assert meter.measured is not None, "the meter did not see its step"
    with torch.device("meta"):
        meta = build()
    dims = trainer.strategy.dims
    plan = trainer.strategy.module_plan(meta, dims, trainer.global_rank)
    estimate = estimate_activations(meta, plan, dims, shape)
    footprint = estimate.rank(0).per_microbatch(estimate.checkpointing)
    assert estimate.peak(0) == footprint.peak  # one microbatch in flight without pipeline parallelism
    return {
        "estimated": {"retained": footprint.retained, "peak": footprint.peak},
        "measured": {"retained": meter.measured.retained, "peak": meter.measured.peak},
        "checkpointing": estimate.checkpointing,
    }
