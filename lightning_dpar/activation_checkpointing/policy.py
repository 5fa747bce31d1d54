"""Selective activation checkpointing's op-level policy, and the checkpoint contexts that apply it.

Full checkpointing keeps only a block's input and recomputes its whole forward in backward: about a third more
compute per step (the forward is a third of a step's FLOPs). torchtitan's op-level policy
(`torchtitan/distributed/activation_checkpoint.py`, `mode = "selective"`, `selective_ac_option = "op"`) keeps the
outputs of the expensive ops instead, so the recomputation redoes only the cheap ones (norms, activations, rotary
embeddings, residual adds, casts): the matmuls' outputs (every second one recomputed, which halves what they keep for
one extra matmul in two), attention's outputs, reduce-scatters' outputs (a sequence-parallel style's collectives,
which would otherwise run again) and `max` (a float8 scale's amax: cheap to keep, and it keeps the recomputed
scale equal to the forward's).

The policy runs through `torch.utils.checkpoint.create_selective_checkpoint_contexts` (public): a dispatch mode
during the forward stores the kept ops' outputs, and one during the recomputation hands them back instead of running
the op again. The kept outputs are real tensors held for backward, so the saved-tensor accounting of the activation
estimate (`lightning_dpar.estimates.activation_trace`, which follows every storage's life) sees them.

`checkpoint_context_fn` composes the policy's contexts with another step's (context parallelism re-enters its
attention interception around the recomputation, `ContextParallel.checkpoint_contexts`): each forward and
recomputation runs inside both, the other step's outermost, so the policy sees the ops that step's code issues.

`checkpoint_forward` checkpoints a module's own `forward`, not its call: the recomputation must issue exactly the
ops its forward did (the policy's replay raises at the first op it did not record). torch's composable `checkpoint`
(what full checkpointing uses) recomputes the module's whole call, hooks included, while its forward ran some hooks
outside the policy's context: FSDP2's pre-forward hook, which runs first, casts the inputs to the compute dtype
under `record_function`, an op the replay then met unrecorded ("profiler._record_function_enter_new.default
encountered during backward but not found in storage", under bf16-mixed; a tensor-parallel style on the block
itself would do the same with its redistribution). Checkpointing the forward keeps every hook outside both, as
torchtitan's checkpoint wrapper inside the FSDP unit does; FSDP's pre-backward hook has unsharded the parameters
before the block's backward recomputes it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lightning_dpar._private_api import selective_checkpoint_private_ops

__all__ = ["SELECTIVE_SAVED_OPS", "ContextFn", "checkpoint_context_fn", "checkpoint_forward", "selective_policy"]

#: `torch.utils.checkpoint`'s `context_fn`: the context managers around a block's forward and its recomputation.
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

#: The matmuls whose outputs the policy keeps (every second one: see `selective_policy`). `addmm` is a `Linear` with
#: a bias on a 2-D (or flattened 3-D) input, which torchtitan's bias-free models never issue but ours do.
_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})

#: The ops whose outputs selective checkpointing keeps: torchtitan's save list (matmuls, every fused attention
#: kernel, the reduce-scatter of sequence parallelism, `max`, float8's scaled matmul) and CPU's fused attention,
#: which the CPU tests and the activation estimate's trace run.
SELECTIVE_SAVED_OPS: frozenset[Any] = _MATMULS | {torch.ops.aten.max.default} | selective_checkpoint_private_ops()


def selective_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh policy for one checkpointed forward: keep the outputs of `SELECTIVE_SAVED_OPS`, except every second
    matmul, and recompute everything else.

    torchtitan's rule: counting the matmuls separately in the forward and in the recomputation, the even-numbered
    ones are recomputed, so a block keeps half its matmul outputs (in a transformer block the other half are cheap
    to redo from the kept ones: a projection's input is the previous op's kept output). The count restarts with each
    forward, so the forward and its recomputation make the same choice for the same op."""
    counts = {False: 0, True: 0}

    def policy(ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_context_fn(selective: bool, other: ContextFn | None) -> ContextFn | None:
    """The `context_fn` of a checkpointed block: the selective policy's contexts when `selective`, with `other`'s
    (another step's, e.g. context parallelism's) around them; `None` when there is nothing to add (full
    checkpointing, no other step's contexts: `torch.utils.checkpoint`'s default)."""
    if not selective:
        return other

    def context_fn() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward, recompute = create_selective_checkpoint_contexts(selective_policy())
        if other is None:
            return forward, recompute
        other_forward, other_recompute = other()
        return _both(other_forward, forward), _both(other_recompute, recompute)

    return context_fn


@contextmanager
def _both(outer: AbstractContextManager[Any], inner: AbstractContextManager[Any]) -> Generator[None, None, None]:
    with ExitStack() as stack:
        stack.enter_context(outer)
        stack.enter_context(inner)
        yield


#: Where `checkpoint_forward` keeps a module's `context_fn`, and the instance-level `forward` it replaced (if any).
_CONTEXT_FN = "_dpar_checkpoint_context_fn"
_FORWARD_BEFORE = "_dpar_forward_before_checkpointing"


def checkpoint_forward(module: nn.Module, context_fn: ContextFn) -> None:
    """Run `module`'s `forward` through `torch.utils.checkpoint.checkpoint` (non-reentrant, with `context_fn`), its
    hooks outside (see the module docstring). The forward is replaced on the instance by a method bound to it, so a
    deep copy of the module (weight averaging's) gets one bound to the copy; names and state-dict keys are
    unchanged."""
    if _FORWARD_BEFORE not in vars(module) and "forward" in vars(module):  # a forward set on the instance before
        object.__setattr__(module, _FORWARD_BEFORE, module.forward)
    object.__setattr__(module, _CONTEXT_FN, context_fn)
    object.__setattr__(module, "forward", types.MethodType(_checkpointed_forward, module))


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = vars(self).get(_FORWARD_BEFORE) or types.MethodType(type(self).forward, self)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=vars(self)[_CONTEXT_FN], **kwargs)
