"""The collectives of context parallelism as autograd functions (`lightning_dpar.context_parallel.exchange`), in one
process: `group=None` simulates one rank of the exchange (this rank's part standing in for the others', as the
activation estimate traces it), and a one-rank gloo group runs the real collectives. Every rank's values on 2 and 4
gloo ranks are checked against whole-sequence attention in `tests/launched/test_context_parallel.py`."""

from __future__ import annotations

import torch

from lightning_dpar.context_parallel.exchange import ExchangeCounter, gather_key_value, gather_sequence, split_sequence
from lightning_dpar.context_parallel.layout import HeadTailLayout

# 8 tokens over 2 ranks in chunks of 2: rank 0 holds chunks 0 and 3, the positions [0, 1, 6, 7].
LAYOUT = HeadTailLayout(2, 0)


def test_split_keeps_this_ranks_positions_and_its_gradient_comes_back_whole_divided_by_the_size():
    full = torch.arange(8.0).view(1, 8, 1).requires_grad_()
    part = split_sequence(full, 1, LAYOUT, group=None)
    assert part.flatten().tolist() == [0.0, 1.0, 6.0, 7.0]
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1)
    (part * weights).sum().backward()
    # simulated: both ranks' gradient parts are this rank's [1, 2 | 3, 4], put back in chunk order, then halved
    assert full.grad.flatten().tolist() == [0.5, 1.0, 0.5, 1.0, 1.5, 2.0, 1.5, 2.0]
    plain = torch.arange(8.0).view(8, 1)
    assert split_sequence(plain, 0, LAYOUT, None).flatten().tolist() == [0.0, 1.0, 6.0, 7.0]  # no grad: indexed only


def test_gather_puts_the_parts_in_global_order_and_its_gradient_is_this_ranks_part_times_the_size():
    part = torch.tensor([10.0, 11.0, 16.0, 17.0]).view(1, 4).requires_grad_()
    whole = gather_sequence(part, 1, LAYOUT, group=None)
    assert whole.flatten().tolist() == [10.0, 11.0, 10.0, 11.0, 16.0, 17.0, 16.0, 17.0]
    (whole * torch.arange(8.0)).sum().backward()
    assert part.grad.flatten().tolist() == [0.0, 2.0, 12.0, 14.0]  # positions 0, 1, 6, 7, times 2


def test_split_then_gather_leaves_the_gradient_outside_the_blocks_exact():
    full = torch.randn(2, 8, 3, requires_grad=True)
    scale = torch.randn(2, 8, 3)
    (gather_sequence(split_sequence(full, 1, LAYOUT, None), 1, LAYOUT, None) * scale).sum().backward()
    # Simulated, the other rank's chunks 1 and 2 are copies of this rank's 0 and 3 (forward and backward alike): the
    # gradient reaching chunk 1 is chunk 0's, chunk 2's is chunk 3's. The factors of 2 cancel.
    torch.testing.assert_close(full.grad, scale[:, [0, 1, 0, 1, 6, 7, 6, 7]])
    held = LAYOUT.positions(8)
    torch.testing.assert_close(full.grad[:, held], scale[:, held])  # exact on the positions this rank holds


def test_keys_are_gathered_along_the_sequence_dim_and_the_bytes_sent_counted():
    counter = ExchangeCounter()
    part = torch.randn(1, 2, 4, 3, requires_grad=True)  # [batch, heads, this rank's 4 tokens, head_dim]
    keys = gather_key_value(part, LAYOUT, None, counter)
    assert keys.shape == (1, 2, 8, 3)
    assert torch.equal(keys[:, :, [0, 1, 6, 7]], part.detach()) and torch.equal(keys[:, :, [2, 3]], part[:, :, :2])
    assert (counter.forward_bytes, counter.backward_bytes) == (1 * 2 * 4 * 3 * 4, 0)  # fp32 to the one other rank
    grad = torch.randn(1, 2, 8, 3)
    keys.backward(grad)
    # simulated reduce-scatter: this rank's own piece of the key gradient, the positions it holds
    assert torch.equal(part.grad, grad[:, :, [0, 1, 6, 7]])
    assert counter.backward_bytes == counter.forward_bytes
    counter.reset()
    assert (counter.forward_bytes, counter.backward_bytes) == (0, 0)


def test_on_a_real_one_rank_group_the_collectives_are_the_identity(gloo_world):
    import torch.distributed as dist

    layout, group = HeadTailLayout(1, 0), dist.group.WORLD
    full = torch.randn(2, 6, 4, requires_grad=True)
    keys = gather_key_value(split_sequence(full, 1, layout, group).transpose(1, 2), layout, group, ExchangeCounter())
    out = gather_sequence(keys.transpose(1, 2), 1, layout, group)
    torch.testing.assert_close(out, full)
    weights = torch.randn(2, 6, 4)
    (out * weights).sum().backward()
    torch.testing.assert_close(full.grad, weights)
