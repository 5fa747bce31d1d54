"""The loss on each context-parallel rank's own tokens (`context_parallel_loss="per_rank"`).

By default the last block's output is gathered whole, so the final norm, the head and the loss run on the whole
sequence on every context-parallel rank: exact for any loss, but the logits (`tokens x vocab`, and the loss's fp32
copy and gradient of them) are whole-sequence activations on every rank. In `"per_rank"` mode the last block's
output stays this rank's part, the final norm and the head run on it, and a transformers causal LM's own loss
(`ForCausalLMLoss`, called when the model gets `labels=`) is replaced for the split forwards by `per_rank_loss`:

- the labels are shifted over the whole sequence first (every context-parallel rank holds the whole batch), so no
  token loses its label at a chunk boundary, and this rank's head-tail part of the shifted labels is taken;
- the token losses of this rank's part are summed in fp32 and divided by the global count of valid tokens (or
  `num_items_in_batch`), which every rank counts from the whole labels without a collective;
- the ranks' sums are all-reduced (`sum_over_ranks`), so every rank holds and logs the global loss. Its backward
  multiplies the gradient by the context-parallel size: FSDP averages gradients over its shard dim, which includes
  the context-parallel ranks, and each rank's gradient covers only its own tokens' loss (`exchange`'s docstring).

The logits the model returns are then this rank's tokens only: `PartialLogits` stands in for them and raises on any
use, naming the fix, so no one reads a part as if it were the whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

from lightning_dpar.context_parallel.layout import HeadTailLayout

__all__ = [
    "LOSS_MODES",
    "OwnLoss",
    "PartialLogits",
    "causal_lm_loss_module",
    "check_labels",
    "check_loss_mode",
    "per_rank_loss",
    "shifted_labels",
    "sum_over_ranks",
]

#: The values of `context_parallel_loss`: the head and loss on the whole sequence (any loss, exact), or on each
#: rank's own tokens (a transformers causal LM's own loss only).
LOSS_MODES = ("whole", "per_rank")


def check_loss_mode(value: object) -> str:
    """`value` if it is one of `LOSS_MODES`; else a `ValueError` naming it and the valid ones."""
    if value not in LOSS_MODES:
        raise ValueError(
            f"`context_parallel_loss={value!r}` is invalid: use 'whole' (the last block's output gathered, the head"
            " and any loss on the whole sequence) or 'per_rank' (each rank's own tokens through the head and a"
            " transformers causal LM's own loss). See docs/context_parallel.md."
        )
    return str(value)


class OwnLoss:
    """A causal LM's `loss_function` under `"per_rank"`: its own (`own`) on a forward that was not split (outside the
    steps), `per_rank_loss` on one whose last block's output stayed this rank's part (`split()` says which)."""

    def __init__(self, own: Callable[..., Tensor], split: Callable[[], bool], layout: HeadTailLayout, group: Any):
        self.own, self.split, self.layout, self.group = own, split, layout, group

    def __call__(self, logits: Tensor, labels: Tensor | None = None, vocab_size: int = 0, **kwargs: Any) -> Tensor:
        if not self.split():
            return self.own(logits=logits, labels=labels, vocab_size=vocab_size, **kwargs)
        return per_rank_loss(logits, labels, vocab_size, self.layout, self.group, **kwargs)


def _is_causal_lm(module: nn.Module) -> bool:
    """Whether `module` is a transformers causal LM computing its own `ForCausalLMLoss` (not one the user set)."""
    if getattr(module, "loss_type", None) != "ForCausalLM":
        return False
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    loss = module.loss_function  # transformers' own, unless the user or an installed `OwnLoss` set another
    return (loss.own if isinstance(loss, OwnLoss) else loss) is ForCausalLMLoss


def causal_lm_loss_module(root: nn.Module, blocks: list[str]) -> str:
    """The name of the transformers causal LM under `root` that holds `blocks` and computes its own loss: the module
    whose loss `"per_rank"` computes on each rank's tokens. Refused (naming what was found) if there is none."""
    found = [name for name, m in root.named_modules() if _is_causal_lm(m)]
    holding = [name for name in found if all(name == "" or block.startswith(f"{name}.") for block in blocks)]
    if len(holding) != 1:
        raise ValueError(
            f"`context_parallel_loss='per_rank'` computes the loss on each rank's own tokens inside a transformers"
            f" causal LM's own loss (its `loss_function`, `ForCausalLMLoss`, called with `labels=`), and"
            f" {type(root).__name__} holds {found or 'none'} around the blocks {blocks[:1]}. Use"
            " `context_parallel_loss='whole'` (any model and loss), or a transformers `...ForCausalLM` that computes"
            " its loss from `labels=` without a replaced `loss_function`."
        )
    return holding[0]


def check_labels(module: nn.Module, where: str, args: tuple, kwargs: dict) -> None:
    """Refuse a forward of the causal LM without `labels` in `"per_rank"` mode: its logits would be this rank's part
    only, and a loss computed from them outside the model would not be the sequence's. `return_dict=False` too: the
    logits in the tuple it returns could not be replaced by `PartialLogits`."""
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    extra = bound.get("kwargs", {})
    labels = bound.get("labels", extra.get("labels"))
    if bound.get("return_dict", extra.get("return_dict")) is False:
        raise ValueError(
            f"{where} was called with `return_dict=False` under `context_parallel_loss='per_rank'`: the logits in the"
            " tuple it returns would be only this rank's tokens, unmarked. Drop `return_dict=False` and use"
            " `outputs.loss`, or set `context_parallel_loss='whole'`."
        )
    if labels is None:
        raise ValueError(
            f"{where} was called without `labels` under `context_parallel_loss='per_rank'`: its"
            " logits are then only this rank's tokens, so a loss computed from them would not be the sequence's."
            " Call the model with `labels=` and use `outputs.loss`, or set `context_parallel_loss='whole'` to"
            " compute your own loss from whole-sequence logits."
        )


def shifted_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """The next-token targets of the whole sequence, as transformers' `ForCausalLMLoss` makes them: `labels` shifted
    left by one, the last position `ignore_index`."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


class _SumOverRanks(Function):
    @staticmethod
    def forward(ctx: Any, part: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
        ctx.size = size
        total = part.clone()
        if group is not None:  # `None`: one rank simulated (the activation estimate)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad * ctx.size, None, None


def sum_over_ranks(part: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    """The sum of every context-parallel rank's `part`; its gradient is the incoming one times `size` (see the module
    docstring: FSDP's average over the context-parallel ranks divides it again)."""
    return _SumOverRanks.apply(part, group, size)


def per_rank_loss(
    logits: Tensor,
    labels: Tensor | None,
    vocab_size: int,
    layout: HeadTailLayout,
    group: dist.ProcessGroup | None,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """`ForCausalLMLoss` of the whole sequence, from this rank's `logits` (its head-tail part, in the order it holds
    them) and the whole sequence's `labels` (or already shifted `shift_labels`): this rank's token losses summed in
    fp32 over the global denominator, summed over the ranks."""
    if shift_labels is None:
        assert labels is not None, "the model computes its loss only when given labels"
        shift_labels = shifted_labels(labels, ignore_index)
    shift_labels = shift_labels.to(logits.device)
    local = layout.take(shift_labels, -1)
    if local.shape[-1] != logits.shape[-2]:
        raise ValueError(
            f"This rank's logits cover {logits.shape[-2]} tokens, where its part of the {shift_labels.shape[-1]}"
            f" labels is {local.shape[-1]}: `context_parallel_loss='per_rank'` needs the logits of every token the"
            " rank holds (no `logits_to_keep`). Set `context_parallel_loss='whole'`."
        )
    if num_items_in_batch is None:
        denominator: Tensor | int = (shift_labels != ignore_index).sum()
    else:
        denominator = num_items_in_batch
        if isinstance(denominator, Tensor):
            denominator = denominator.to(logits.device)
    summed = F.cross_entropy(
        logits.float().reshape(-1, vocab_size), local.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return sum_over_ranks(summed / denominator, group, layout.size)


_REFUSED = (
    "__len__ __iter__ __getitem__ __float__ __int__ __bool__ __array__ __add__ __radd__ __sub__ __rsub__ __mul__"
    " __rmul__ __truediv__ __rtruediv__ __matmul__ __rmatmul__ __neg__ __lt__ __le__ __gt__ __ge__"
).split()


class PartialLogits:
    """What a causal LM's `outputs.logits` is under `context_parallel_loss="per_rank"`: this rank's logits are a
    part of the sequence (two chunks of its tokens), not what one process would return, so any use raises, naming
    the fix. `outputs.loss` is the whole sequence's loss."""

    def __init__(self, shape: tuple[int, ...], seq_len: int, layout: HeadTailLayout) -> None:
        self._message = (
            f"`outputs.logits` is not available under `context_parallel_loss='per_rank'`: each context-parallel rank"
            f" computed the logits of its own {shape[-2]} of the sequence's {seq_len} tokens only (two of its"
            f" {2 * layout.size} chunks), not the whole sequence's. Use"
            " `outputs.loss` (the whole sequence's loss, on every rank), or set `context_parallel_loss='whole'` to"
            " get whole-sequence logits."
        )

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(self._message)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise RuntimeError(self.__dict__["_message"])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        partial = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, PartialLogits))
        raise RuntimeError(partial._message)

    def __repr__(self) -> str:
        return "PartialLogits(this context-parallel rank's part; use `outputs.loss`)"


for _name in _REFUSED:
    setattr(PartialLogits, _name, PartialLogits._refuse)
del _name
