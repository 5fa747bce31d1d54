"""Selective activation checkpointing's op-level policy (`lightning_dpar.activation_checkpointing.policy`): which
ops it keeps, that a block checkpointed with it computes the gradients of the block run plainly, that it really runs
fewer ops again in backward than full checkpointing, and that another step's contexts are entered around it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, checkpoint

from lightning_dpar.activation_checkpointing.policy import (
    SELECTIVE_SAVED_OPS,
    checkpoint_context_fn,
    selective_policy,
)

aten = torch.ops.aten


def test_every_second_matmul_is_recomputed_counting_forward_and_recomputation_apart():
    policy = selective_policy()
    forward, recompute = SelectiveCheckpointContext(is_recompute=False), SelectiveCheckpointContext(is_recompute=True)
    decisions = [policy(forward, aten.mm.default) for _ in range(3)]
    assert decisions == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE]
    # the recomputation counts from one again, so it makes the forward's choice for the same matmul
    assert [policy(recompute, aten.addmm.default) for _ in range(3)] == decisions


@pytest.mark.parametrize(
    ("op", "kept"),
    [
        (aten._scaled_dot_product_flash_attention_for_cpu.default, True),
        (aten._scaled_dot_product_efficient_attention.default, True),
        (torch.ops._c10d_functional.reduce_scatter_tensor.default, True),
        (aten.max.default, True),
        (aten.gelu.default, False),
        (aten.add.Tensor, False),
        (aten.native_layer_norm.default, False),
    ],
)
def test_attention_and_collectives_are_kept_and_cheap_ops_recomputed(op, kept):
    decision = selective_policy()(SelectiveCheckpointContext(is_recompute=False), op)
    assert (decision == CheckpointPolicy.MUST_SAVE) is kept
    assert (op in SELECTIVE_SAVED_OPS) is kept


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 16)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(x)))


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _step(context_fn=None) -> tuple[dict[str, torch.Tensor], Counter]:
    """The block's gradients, and the ops its backward ran (the recomputation's among them)."""
    block = Block()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    if context_fn is None:
        out = block(x)
    elif context_fn == "full":
        out = checkpoint(block, x, use_reentrant=False)
    else:
        out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    with OpCounter() as counter:
        out.square().sum().backward()
    return {name: p.grad for name, p in block.named_parameters()}, counter.ops


def test_a_selectively_checkpointed_block_has_the_plain_gradients_and_recomputes_only_cheap_ops():
    plain, plain_ops = _step()
    full, full_ops = _step("full")
    context_fn = checkpoint_context_fn(selective=True, other=None)
    assert context_fn is not None
    selective, selective_ops = _step(context_fn)
    for name, grad in plain.items():
        assert torch.equal(selective[name], grad), name
        assert torch.equal(full[name], grad), name
    matmuls = (aten.addmm.default, aten.mm.default)
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    recomputed = {op: n - plain_ops[op] for op, n in selective_ops.items() if n > plain_ops[op]}
    full_recomputed = {op: n - plain_ops[op] for op, n in full_ops.items() if n > plain_ops[op]}
    # Full checkpointing runs the attention and 3 of the 4 Linear layers again (the recomputation stops early: the
    # last Linear's output is needed by no backward). Selective keeps the attention's output and the 1st and 3rd
    # Linear's, so of the matmuls it recomputes only the 2nd (the 4th again stopped early), and the norm and GELU.
    assert sum(full_recomputed.get(op, 0) for op in matmuls) == 3
    assert full_recomputed.get(attention) == 1
    assert sum(recomputed.get(op, 0) for op in matmuls) == 1
    assert attention not in recomputed
    assert recomputed.get(aten.gelu.default) == 1
    assert recomputed.get(aten.native_layer_norm.default) == 1


def test_no_policy_and_no_other_contexts_leave_the_checkpoint_default():
    assert checkpoint_context_fn(selective=False, other=None) is None

    def other():
        return _Entered("forward"), _Entered("recompute")

    assert checkpoint_context_fn(selective=False, other=other) is other


entered: list[str] = []


class _Entered:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        entered.append(self.name)

    def __exit__(self, *exc: object) -> None:
        entered.append(f"/{self.name}")


def test_another_steps_contexts_are_entered_around_the_policys_in_forward_and_recomputation():
    """Context parallelism's contexts (here, recording ones) stay entered around the block's forward and its
    recomputation under the selective policy, and the gradients are unchanged."""
    entered.clear()
    context_fn = checkpoint_context_fn(selective=True, other=lambda: (_Entered("forward"), _Entered("recompute")))
    grads, _ = _step(context_fn)
    assert entered == ["forward", "/forward", "recompute", "/recompute"]
    plain, _ = _step()
    assert all(torch.equal(grads[name], grad) for name, grad in plain.items())
