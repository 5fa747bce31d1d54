"""A small GPT-style decoder written to be tensor-parallel friendly, and its LightningModule.

Attention keeps separate `q`, `k`, `v` projections (a fused `qkv` weight cannot be split column-wise without
mixing the three), and reshapes with `-1` heads, so the same code runs on a full layer or on a column-wise shard
that holds `n_head / tensor_parallel_size` heads. `GPT.tp_plan` is the Megatron layout: `q/k/v` and `mlp.fc`
column-wise, `attn.proj` and `mlp.proj` row-wise (one all-reduce per sub-layer in forward).

With `n_experts > 0` each block's feed-forward is a Mixture of Experts (`lightning_dpar.examples.moe`): a top-k router
and experts that `expert_parallel_size` splits between ranks; the tensor-parallel plan then covers attention only.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpar.examples.moe import MoE

__all__ = [
    "GPT",
    "MOE_TP_PLAN",
    "TP_PLAN",
]

#: Module-name patterns (relative to the LightningModule) -> tensor-parallel style; see `lightning_dpar.plan`.
TP_PLAN: dict[str, str] = {
    "model.blocks.*.attn.[qkv]": "colwise",
    "model.blocks.*.attn.proj": "rowwise",
    "model.blocks.*.mlp.fc": "colwise",
    "model.blocks.*.mlp.proj": "rowwise",
}
#: The plan of the MoE variant: attention only (expert parallelism splits the experts).
MOE_TP_PLAN: dict[str, str] = {pattern: style for pattern, style in TP_PLAN.items() if ".attn." in pattern}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"`n_embd={n_embd}` must be a multiple of `n_head={n_head}`.")
        self.head_dim = n_embd // n_head
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.k = nn.Linear(n_embd, n_embd, bias=False)
        self.v = nn.Linear(n_embd, n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # -1 heads: all of them unsharded, n_head / tp on a column-wise shard.
        q, k, v = (f(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: the unit `fully_shard` and activation checkpointing wrap. With `n_experts > 0` its
    feed-forward is a Mixture of Experts choosing `experts_per_token` experts per token."""

    def __init__(
        self, n_embd: int, n_head: int, n_experts: int = 0, experts_per_token: int = 2, grouped: bool = False
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp: nn.Module = MoE(n_embd, n_experts, experts_per_token, grouped) if n_experts else MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    """Token and position embeddings, `n_layer` blocks in an `nn.ModuleList`, final norm and LM head."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        n_experts: int = 0,
        experts_per_token: int = 2,
        experts_grouped_mm: bool = False,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, n_experts, experts_per_token, experts_grouped_mm) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.n_layer = n_layer

    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # LayerNorm weights/biases keep their own init
            residual = name.endswith(("proj.weight", "experts.proj"))
            std = 0.02 / math.sqrt(2 * self.n_layer) if residual else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPT(L.LightningModule):
    """Byte-level GPT: next-byte prediction with cross-entropy, AdamW with a linear warm-up.

    Args:
        vocab_size: 256 for raw bytes.
        block_size: context length in tokens.
        n_layer: number of transformer blocks.
        n_head: attention heads (a multiple of the tensor-parallel size).
        n_embd: model width (a multiple of `n_head`).
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW weight decay of the matrices (norms and biases get none).
        warmup_steps: linear warm-up length in optimizer steps.
        n_experts: experts per Mixture-of-Experts feed-forward (0: dense blocks).
        experts_per_token: experts the router chooses per token.
        experts_grouped_mm: compute the experts with grouped matmuls (`torch._grouped_mm`; the GPU preset) instead
            of a loop over the chosen experts.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        n_experts: int = 0,
        experts_per_token: int = 2,
        experts_grouped_mm: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Decoder(
            vocab_size, block_size, n_layer, n_head, n_embd, n_experts, experts_per_token, experts_grouped_mm
        )
        self.model.init_weights()
        self.tp_plan = dict(MOE_TP_PLAN if n_experts else TP_PLAN)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            betas=(0.9, 0.95),
        )
        warmup = max(1, hp.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
