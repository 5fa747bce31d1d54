"""The facts about a model the layout cost model needs, read once off the (meta-device) model: parameter counts,
the transformer's shape (layers, width, heads, vocabulary), experts, and the batch one data-parallel rank trains on.

`ModelFacts` is plain data, so the cost model and the search are pure functions of it (tests build it by hand);
`facts_of(module, ...)` reads it off a model, by structure only (no forward pass):

- layers: the longest `nn.ModuleList` (the repeated blocks, as the planner's default units);
- width and vocabulary: the largest `nn.Embedding` (its `embedding_dim`, `num_embeddings`);
- heads: the first of `num_attention_heads` / `n_head` / `num_heads` found on a `config`, on `hparams`, or on a
  submodule (0 when none is found: then the activation formula drops its attention-score term);
- experts: the modules that follow the experts contract of `lightning_dpar.experts.plan` (`find_experts`), and the
  experts each token chooses from `top_k` / `num_experts_per_tok` / `experts_per_token` on a submodule or config;
- the parameters float8 training would convert (`float8_linears`): the float8 step's own rule (the `nn.Linear`
  layers whose features are multiples of 16, what float8 matmuls take, but the output layer or the `float8_skip`
  patterns), less experts'. The cost model runs their matmuls at the profile's float8 rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_dpar.activation_checkpointing.cost import recompute_factor
from lightning_dpar.activation_checkpointing.step import Checkpointing
from lightning_dpar.experts.cost import TOP_K_NAMES, active_params, moe_shape
from lightning_dpar.experts.plan import find_experts
from lightning_dpar.float8.cost import converted_flops_per_token
from lightning_dpar.float8.step import convertible_linears
from lightning_dpar.helpers import is_under

__all__ = ["ModelFacts", "facts_of", "float8_linears"]


_HEAD_NAMES = ("num_attention_heads", "n_head", "num_heads")


@dataclass(frozen=True)
class ModelFacts:
    """A model and its batch, as the cost model sees them. `batch_size` is samples per data-parallel rank per step
    (what each rank's data loader yields); `param_bytes` the parameters' element size (fp32 master weights under
    "bf16-mixed"), `activation_bytes` the compute dtype's."""

    params: int
    layers: int
    hidden: int
    vocab: int
    seq_len: int
    batch_size: int
    heads: int = 0
    embedding_params: int = 0  # lookups, no matmul FLOPs
    expert_params: int = 0  # all experts of all MoE layers
    experts: int = 0  # per MoE layer; 0: dense
    experts_per_token: int = 0
    moe_layers: int = 0
    param_bytes: int = 4
    activation_bytes: int = 4
    float8_params: int = 0  # the weights of the `nn.Linear` layers float8 training converts (`float8_linears`)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: every non-expert parameter and `k / E` of the experts."""
        return active_params(self.params, self.expert_params, self.experts, self.experts_per_token)

    def flops_per_token(self, recompute: Checkpointing = False, selective_share: float | None = None) -> float:
        """Training FLOPs per token: 6 x the active parameters that multiply activations (forward 2, backward 4),
        plus attention's 12 x layers x width x sequence (PaLM's count); full activation checkpointing recomputes the
        forward once more (8 instead of 6), selective checkpointing `selective_share` of what full recomputes (the
        traced step's share, `StepFlops`; `None`: not traced, priced as full, an upper bound)."""
        matmul = 6.0 * (self.active_params - self.embedding_params) + 12.0 * self.layers * self.hidden * self.seq_len
        return matmul * recompute_factor(recompute, selective_share)

    def float8_flops_per_token(self, recompute: Checkpointing = False, selective_share: float | None = None) -> float:
        """The part of `flops_per_token` that float8 training runs in float8: 6 x the converted weights
        (`float8_params`: each of their forward and backward matmuls is converted), recomputed alike. A model: the
        recomputed share is taken as spread evenly over the matmuls."""
        return converted_flops_per_token(self.float8_params, recompute_factor(recompute, selective_share))

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one data-parallel rank trains on per step."""
        return self.batch_size * self.seq_len


def float8_linears(module: nn.Module, skip: Sequence[str] | None = None) -> list[str]:
    """The `nn.Linear` modules of `module` float8 training converts (the float8 step's own rule,
    `lightning_dpar.float8.step.convertible_linears`: `skip` are the `float8_skip=` patterns, None keeping the output
    layer in high precision), but those inside an experts module, which the float8 step refuses."""
    experts = find_experts(module)
    return [fqn for fqn in convertible_linears(module, skip) if not is_under(fqn, experts)]


def _first_int(objects: list[Any], names: tuple[str, ...]) -> int:
    for obj in objects:
        for name in names:
            value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def facts_of(
    module: nn.Module,
    seq_len: int,
    batch_size: int,
    precision: str = "32-true",
    float8_skip: Sequence[str] | None = None,
) -> ModelFacts:
    """`ModelFacts` of `module` (any device, meta included) training `batch_size` sequences of `seq_len` tokens per
    data-parallel rank at `precision`; `float8_skip`: the strategy's patterns of `nn.Linear` modules float8 training
    leaves alone."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(
            f"`seq_len={seq_len}`, `batch_size={batch_size}`: both must be positive (tokens per sequence and"
            " sequences per data-parallel rank per step)."
        )
    params = sum(p.numel() for p in module.parameters())
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    layers = max((len(m) for m in lists), default=1) or 1
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    largest = max(embeddings, key=lambda m: m.num_embeddings, default=None)
    hidden = largest.embedding_dim if largest is not None else 0
    if not hidden:  # no embedding: the widest square-ish Linear
        hidden = max((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), default=1)
    sources: list[Any] = [getattr(m, "config", None) for m in module.modules()]
    sources += [dict(getattr(module, "hparams", {}) or {})]
    sources += list(module.modules())
    sources = [s for s in sources if s is not None]
    moe = moe_shape(module)
    bf16 = precision in ("bf16-mixed", "bf16-true", "16-mixed")
    return ModelFacts(
        params=params,
        layers=layers,
        hidden=hidden,
        vocab=largest.num_embeddings if largest is not None else 0,
        seq_len=seq_len,
        batch_size=batch_size,
        heads=_first_int(sources, _HEAD_NAMES),
        embedding_params=sum(p.numel() for m in embeddings for p in m.parameters()),
        expert_params=moe.expert_params,
        experts=moe.experts,
        experts_per_token=_first_int(sources, TOP_K_NAMES) if moe.experts else 0,
        moe_layers=moe.moe_layers,
        param_bytes=2 if precision == "bf16-true" else 4,
        activation_bytes=2 if bf16 else 4,
        float8_params=sum(module.get_submodule(fqn).weight.numel() for fqn in float8_linears(module, float8_skip)),
    )
