"""The head-tail split (`lightning_dpar.context_parallel.layout`): every token on exactly one rank, the parts
reassembled in order, the per-rank causal attention work balanced, and lengths the split cannot cut refused."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.context_parallel.layout import HeadTailLayout, attention_work, cpu_mask_bytes, key_value_sends


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_every_position_is_held_by_exactly_one_rank_and_reassembles_in_order(size):
    seq_len = 2 * size * 3
    layouts = [HeadTailLayout(size, r) for r in range(size)]
    held = torch.cat([layout.positions(seq_len) for layout in layouts])
    assert sorted(held.tolist()) == list(range(seq_len))
    assert torch.equal(layouts[0].key_positions(seq_len), held)
    full = torch.arange(2 * seq_len * 5, dtype=torch.float32).view(2, seq_len, 5)
    parts = [layout.take(full, 1) for layout in layouts]
    for layout, part in zip(layouts, parts):
        assert torch.equal(part, full[:, layout.positions(seq_len)])
    assert torch.equal(layouts[0].assemble(parts, 1), full)


def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r():
    layout = HeadTailLayout(4, 1)
    assert layout.chunks() == (1, 6)
    assert layout.positions(16).tolist() == [2, 3, 12, 13]


def test_causal_work_is_balanced_only_with_the_head_tail_split():
    seq_len, size = 4096, 4
    balanced, contiguous = attention_work(seq_len, size), attention_work(seq_len, size, balanced=False)
    assert sum(balanced) == sum(contiguous) == seq_len * (seq_len + 1) // 2
    assert max(balanced) / min(balanced) < 1.001  # equal up to one chunk's diagonal
    assert max(contiguous) / min(contiguous) > 2 * size - 1.01  # the last rank does ~7x the first's work


@pytest.mark.parametrize(("seq_len", "size"), [(6, 2), (12, 4), (7, 1)])
def test_a_length_that_does_not_divide_by_twice_the_size_is_refused(seq_len, size):
    with pytest.raises(ValueError, match=rf"sequence length {seq_len} .* does not divide by 2 x context_parallel_size"):
        HeadTailLayout(size, 0).check(seq_len, "block 'layers.0'")


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [False, True])
def test_each_rank_s_attention_to_the_gathered_keys_equals_its_rows_of_whole_sequence_attention(size, causal, gqa):
    """What each rank computes (`attention.attend`: its two chunks, each against the keys up to its own end with a
    lower-right causal bias, or all keys) equals its rows of attention over the whole sequence, values and
    gradients, with grouped-query attention too."""
    from lightning_dpar.context_parallel.attention import attend

    torch.manual_seed(0)
    seq_len, kv_heads = 4 * size, 2 if gqa else 4
    q = torch.randn(2, 4, seq_len, 8, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq_len, 8, requires_grad=True) for _ in range(2))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    weights = torch.randn_like(whole)
    want = torch.autograd.grad((whole * weights).sum(), (q, k, v))
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(size):
        layout = HeadTailLayout(size, rank)
        mine = attend(layout.take(q, 2), k, v, layout, causal, enable_gqa=gqa)
        torch.testing.assert_close(mine, layout.take(whole, 2), atol=1e-6, rtol=0)
        for total, grad in zip(got, torch.autograd.grad((mine * layout.take(weights, 2)).sum(), (q, k, v))):
            total += grad  # the keys' gradients summed over ranks, as the exchange's reduce-scatter does
    for total, expected in zip(got, want):
        torch.testing.assert_close(total, expected, atol=1e-5, rtol=0)


def test_the_activation_estimate_knows_context_parallelism():
    """The dry run's estimate traces one context-parallel rank (the same hooks and attention, collectives
    simulated): the blocks' activations divide by the size, the embedding's and the head's do not."""
    from lightning_dpar import FullyShardStrategy
    from lightning_dpar.estimates.activations import estimate_activations
    from lightning_dpar.examples.gpt import GPT
    from lightning_dpar.parallel.parallelize import plan_modules

    retained = {}
    for cp in (1, 2, 4):
        with torch.device("meta"):
            module = GPT(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)
        strategy = FullyShardStrategy(context_parallel_size=cp)
        dims = strategy.resolve_dims(4, 4, 1)
        estimate = estimate_activations(module, plan_modules(module, dims, strategy.plan_options, 0), dims, (2, 65))
        retained[cp] = estimate.rank(0).per_microbatch(False).retained
    assert retained[4] < retained[2] < retained[1]


@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_all_gather_sends_four_thirds_of_the_least_exchange_under_causal_attention(size):
    """Rank j's head chunk is needed by every rank, its tail chunk only by ranks 0..j-1 (whose last query comes
    later): 1.5 N (N - 1) chunks at least, against the all-gather's 2 N (N - 1); full attention needs everything."""
    seq_len = 2 * size * 16
    gathered, least = key_value_sends(seq_len, size)
    chunk = seq_len // (2 * size)
    assert sum(gathered) == 2 * size * (size - 1) * chunk
    assert sum(least) == 3 * size * (size - 1) // 2 * chunk
    assert least[-1] == gathered[-1] and least[0] == gathered[0] // 2  # the last rank sends no more than it must
    assert key_value_sends(seq_len, size, causal=False) == (gathered, gathered)


def test_the_cpu_masks_are_each_chunk_times_the_keys_before_its_end_in_floats():
    # 16 tokens on 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3 (keys up to 4 and 16), rank 1 chunks 1 and 2
    assert cpu_mask_bytes(16, 2, rank=0) == 4 * (4 * 4 + 4 * 16)
    assert cpu_mask_bytes(16, 2, rank=1) == 4 * (4 * 8 + 4 * 12)
    assert cpu_mask_bytes(8, 1) == 4 * (4 * 4 + 4 * 8)
