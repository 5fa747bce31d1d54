"""Context parallelism at run time: the sequence split at the model's repeated blocks.

`ContextParallel.install` hooks the blocks of the model's one list of repeated blocks (the transformer layers):

- the first block's input, whole on every context-parallel rank, is cut to this rank's head-tail part, and so is
  every other tensor argument of any block that still spans the whole sequence (a transformers model's rotary
  `position_embeddings`, computed once from the global positions, or `position_ids`): rotary embeddings see global
  positions without any change to the model;
- inside the blocks, `scaled_dot_product_attention` attends to every rank's keys and values (`attention`);
- the last block's output is gathered whole again, so the final norm, the head and the user's loss (its next-token
  shift, `ignore_index`, its average over valid tokens) run on the whole sequence exactly as in one process, and
  every rank computes (and logs) the global loss;
- or, with a `loss_module` (`context_parallel_loss="per_rank"`), it stays this rank's part: the final norm and the
  head run on it, and that transformers causal LM's loss is computed on this rank's tokens and summed over the
  ranks (`loss`). A forward of it without `labels` is refused, and its `logits` are replaced by `PartialLogits`.

The blocks' activations, attention included, are split `size` ways; the embedding's output and the logits are
not. The hooks act only inside `ContextParallel.active()`, which the strategy opens around each step's forward: a
forward outside the steps runs on the whole sequence, unsplit.

With pipeline parallelism a rank runs some of the blocks: per stage a run of consecutive blocks (`checks.block_runs`).
A run that starts after the model's first block receives this rank's part from the previous stage: its input is not
cut again (the whole sequence is `size` times it), while the other whole-sequence arguments, computed on every stage
(rotary embeddings), are cut as at the first block. A run that ends before the model's last block sends its part on,
not gathered. So the stages send each other `size` times less than the whole sequence, and the gradient crossing a
boundary carries the blocks' factor `size` (`exchange`) from the last block's gather back to the first block's split.
Each stage's forward opens and closes the split (the schedule runs other stages and microbatches in between).

Activation checkpointing recomputes a block in backward, outside `active()`: `checkpoint_contexts` (the
checkpoint's `context_fn`) re-enters the attention interception for the recomputation with the sequence length of
the forward it repeats, so the recomputed attention exchanges keys and values and attends to every rank's again.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_dpar.context_parallel.attention import ContextParallelAttention, SdpaInterceptor
from lightning_dpar.context_parallel.checks import block_runs, sequence_blocks
from lightning_dpar.context_parallel.exchange import gather_sequence, split_sequence
from lightning_dpar.context_parallel.layout import HeadTailLayout
from lightning_dpar.context_parallel.loss import OwnLoss, PartialLogits, check_labels

__all__ = ["ContextParallel"]


class ContextParallel:
    """The hooks and attention state of one model under context parallelism: rank `layout.rank` of `layout.size`
    ranks exchanging over `group` (`None`: one rank simulated in one process, for the activation estimate). `blocks`
    are the blocks this rank runs, `order` every block of the model (default: `blocks`), `runs` the blocks each of
    this rank's pipeline stages runs (`checks.block_runs`; default: all in one); with a `loss_module` (a transformers
    causal LM holding the blocks), its loss on this rank's own tokens."""

    def __init__(
        self,
        blocks: list[tuple[str, nn.Module]],
        layout: HeadTailLayout,
        group: dist.ProcessGroup | None,
        runs: Sequence[Sequence[str]] | None = None,
        order: Sequence[str] | None = None,
        loss_module: tuple[str, nn.Module] | None = None,
    ) -> None:
        self.layout = layout
        self.group = group
        self.attention = ContextParallelAttention(self.layout, group)
        names = [name for name, _ in blocks] if order is None else list(order)
        runs = [names] if runs is None else runs
        #: The blocks whose input arrives as this rank's part (a pipeline stage's first block after the model's
        #: first), and those whose output leaves as it (a stage's last block before the model's last).
        self._enters_split = {run[0] for run in runs if run[0] != names[0]}
        self._leaves_split = {run[-1] for run in runs if run[-1] != names[-1]}
        self._last_name = names[-1]
        self._blocks = blocks
        self._enabled = False
        self._calls_at_entry = 0
        self._handles: list[RemovableHandle] = []
        for name, block in self._blocks:
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True, prepend=True))
            self._handles.append(block.register_forward_hook(self._post_hook(name), with_kwargs=True))
        #: Whether the last block's output was left this rank's part, for the loss module's loss and output.
        self._partial_output = False
        self._loss_module = loss_module[1] if loss_module is not None else None
        if loss_module is not None:
            name, module = loss_module
            self._loss_where = f"Module {name or '(root)'!r} ({type(module).__name__})"
            self._own_loss = module.loss_function
            module.loss_function = OwnLoss(self._own_loss, lambda: self._partial_output, layout, group)
            self._handles.append(module.register_forward_pre_hook(self._loss_pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._loss_post_hook))

    @classmethod
    def install(
        cls,
        root: nn.Module,
        group: dist.ProcessGroup,
        blocks: Sequence[str] | None = None,
        loss_module: str | None = None,
        stages: Sequence[Sequence[str]] | None = None,
    ) -> ContextParallel:
        """Hook `root`'s `blocks` (the plan's `ModulePlan.context_parallel`: every block of the model, in order;
        default: `checks.sequence_blocks`) for context parallelism over `group`; with `loss_module`
        (`ModulePlan.context_parallel_loss`), that causal LM's loss per rank; with pipeline parallelism only the
        blocks of this rank's `stages` (each stage's units), the others being remote units."""
        names = [name for name, _ in sequence_blocks(root)] if blocks is None else list(blocks)
        runs = block_runs(names, stages)
        found = [(name, root.get_submodule(name)) for run in runs for name in run]
        layout = HeadTailLayout(dist.get_world_size(group), dist.get_rank(group))
        loss = None if loss_module is None else (loss_module, root.get_submodule(loss_module))
        return cls(found, layout, group, runs, names, loss_module=loss)

    @classmethod
    def simulate(cls, root: nn.Module, size: int, loss_module: str | None = None) -> ContextParallel:
        """One rank of `size` simulated in this process: the same split, hooks and attention, with collectives that
        only allocate what the real ones would (what `lightning_dpar.estimates` traces)."""
        module = None if loss_module is None else (loss_module, root.get_submodule(loss_module))
        return cls(sequence_blocks(root), HeadTailLayout(size, 0), None, loss_module=module)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._loss_module is not None:  # the model's own loss back
            self._loss_module.loss_function = self._own_loss

    def _loss_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._enabled:
            check_labels(module, self._loss_where, args, kwargs)

    def _loss_post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._partial_output:
            self._partial_output = False
            logits = getattr(output, "logits", None)
            if isinstance(logits, Tensor):
                output.logits = PartialLogits(tuple(logits.shape), logits.shape[-2] * self.layout.size, self.layout)

    @contextmanager
    def active(self) -> Generator[None, None, None]:
        """Split the sequence at the blocks, and make their attention context-parallel, inside this context."""
        self._enabled = True
        try:
            with SdpaInterceptor(self.attention):
                yield
        finally:
            self._enabled = False
            self._partial_output = False
            self.attention.end()

    def checkpoint_contexts(self) -> tuple[AbstractContextManager, AbstractContextManager]:
        """Activation checkpointing's `context_fn` for a block: nothing around the forward, and around its
        recomputation in backward (where `active()` has long closed) the attention interception again, with the
        forward's sequence length. Called by the checkpoint as the block's forward starts, after the split."""
        seq_len = self.attention.seq_len
        if not self._enabled or seq_len is None:
            return nullcontext(), nullcontext()
        return nullcontext(), self._recomputing(seq_len, self.attention.where)

    @contextmanager
    def _recomputing(self, seq_len: int, where: str) -> Generator[None, None, None]:
        saved = self.attention.seq_len, self.attention.where
        self.attention.seq_len, self.attention.where = seq_len, where
        try:
            with SdpaInterceptor(self.attention):
                yield
        finally:
            self.attention.seq_len, self.attention.where = saved

    def _split(self, value: Any) -> Any:
        """`value` with every tensor spanning the whole sequence (dim 1, or dim 0 of a 1-D tensor) cut to this rank's
        part; tuples and lists are searched too."""
        seq_len = self.attention.seq_len
        if isinstance(value, (tuple, list)):
            items = [self._split(v) for v in value]
            if all(new is old for new, old in zip(items, value)):
                return value  # nothing spans the sequence (a `torch.Size`, say): kept as it is
            # a plain tuple or list from its items; a tuple subclass (a namedtuple) from them as arguments
            return type(value)(items) if type(value) in (tuple, list) else type(value)(*items)
        if not isinstance(value, Tensor):
            return value
        dim = 1 if value.dim() >= 2 else 0
        if value.dim() == 0 or value.shape[dim] != seq_len:
            return value
        if isinstance(value, DTensor):
            raise ValueError(
                "A block received a DTensor spanning the sequence: context parallelism splits plain tensors and does"
                " not compose with sequence-parallel tensor-parallel styles yet. Use 'colwise'/'rowwise' styles."
            )
        return split_sequence(value, dim, self.layout, self.group)

    def _pre_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not self._enabled:
                return None
            if not self.attention.active:
                hidden = next((v for v in (*args, *kwargs.values()) if isinstance(v, Tensor) and v.dim() >= 2), None)
                if hidden is None:
                    raise ValueError(f"Block {name!r} got no tensor argument with a sequence dim (dim 1) to split.")
                # Past a pipeline stage boundary the hidden states arrive as this rank's part already.
                seq_len = hidden.shape[1] * (self.layout.size if name in self._enters_split else 1)
                self.layout.check(seq_len, f"block {name!r}")
                self.attention.begin(seq_len)
            self.attention.where = f"Module {name!r} ({type(module).__name__})"
            self._calls_at_entry = self.attention.calls
            return self._split(args), {k: self._split(v) for k, v in kwargs.items()}

        return hook

    def _post_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if not self._enabled or not self.attention.active:
                return None
            if self.attention.calls == self._calls_at_entry:
                self.attention.end()
                raise ValueError(
                    f"Block {name!r} ({type(module).__name__}) ran under context parallelism without calling"
                    " torch.nn.functional.scaled_dot_product_attention, so its attention cannot be made"
                    " context-parallel (it would attend only to this rank's part of the sequence). Make its attention"
                    " call scaled_dot_product_attention (a transformers model: `attn_implementation='sdpa'`), or set"
                    " `context_parallel_size=1`."
                )
            if name in self._leaves_split:
                self.attention.end()  # this rank's part goes on to the next pipeline stage
                return None
            if name != self._last_name:
                return None
            seq_len = self.attention.seq_len
            self.attention.end()
            if self._loss_module is not None:
                self._partial_output = True  # the final norm, the head and the loss run on this rank's part
                return None
            if isinstance(output, Tensor):
                return gather_sequence(output, 1, self.layout, self.group)
            if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
                return (gather_sequence(output[0], 1, self.layout, self.group), *output[1:])
            raise ValueError(
                f"The last block {name!r} returned {type(output).__name__}; context parallelism gathers the sequence"
                f" ({seq_len} tokens) from a tensor output or a tuple whose first item is the hidden states."
            )

        return hook
