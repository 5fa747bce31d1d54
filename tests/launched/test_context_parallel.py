"""Context parallelism through real Trainers on 2 and 4 gloo ranks (cases in `tests/workers/context_parallel.py`):
the example GPT and transformers decoders (Llama, Qwen2, Qwen3, Mistral) with each sequence split between ranks, CP
alone, CP x FSDP and CP x TP (CP x PP: `test_context_parallel_pipeline.py`), each ending with the parameters of one
process on the same global batches; every rank logging its batch's whole-sequence loss; and each refusal raised
alike on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


ATOL = 1e-5
GROUPS = "context_parallel,context_parallel_errors,context_parallel_memory,context_parallel_loss"


SHARED_LAUNCH = {2: GROUPS, 4: GROUPS}


@pytest.fixture(scope="module")
def cp2(shared_launch):
    return shared_launch(2)


@pytest.fixture(scope="module")
def cp4(shared_launch):
    return shared_launch(4)


def _check_parity(result: dict, world: int) -> None:
    assert result["max_abs_diff"] < ATOL
    assert result["loss_diff"] < ATOL  # every rank logged its data-parallel batch's whole-sequence loss
    assert result["steps"] == [3] * world
    assert result["kv_bytes_sent_rank0"] > 0  # the sequence was split: attention exchanged keys and values


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "case"),
    [
        *(("cp2", f"{m}_cp2") for m in ("gpt", "llama", "qwen2", "qwen3", "mistral", "qwen3_moe")),
        *(("cp4", f"{m}_cp4") for m in ("gpt", "llama", "qwen2", "qwen3", "mistral", "qwen3_moe")),
        ("cp2", "gpt_dpar_cp"),
        ("cp4", "gpt_dpar_cp"),
    ],
)
def test_context_parallel_training_matches_one_process(world, case, request):
    """The whole sequence split over every rank (CP 2, CP 4): causal masking across chunk boundaries, rotary
    positions, the next-token shift and the loss's average all as in one process; a Qwen3-MoE's experts too (its
    tokens routed on each rank's part; without the router's load-balancing loss, which is refused)."""
    _check_parity(request.getfixturevalue(world)[case], 2 if world == "cp2" else 4)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["cp2", "cp4"])
def test_ignore_index_tokens_spread_unevenly_keep_the_global_average(world, request):
    """Labels with runs of `-100` mostly in the sequence's head: the ranks' parts hold different numbers of valid
    tokens, and the loss is still the average over the sequence's valid tokens."""
    size = 2 if world == "cp2" else 4
    _check_parity(request.getfixturevalue(world)[f"llama_cp{size}_ignore_index"], size)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "dims"),
    [
        ("gpt_cp2_fsdp2", "shard 4 (data_shard 2 x context 2) x tensor_parallel 1"),
        ("llama_cp2_fsdp2", "shard 4 (data_shard 2 x context 2) x tensor_parallel 1"),
        ("gpt_cp2_tp2", "shard 2 (data_shard 1 x context 2) x tensor_parallel 2"),
        ("llama_cp2_tp2", "shard 2 (data_shard 1 x context 2) x tensor_parallel 2"),
        ("gpt_cp2_hsdp2", "replicate 2 x shard 2 (data_shard 1 x context 2) x tensor_parallel 1"),
    ],
)
def test_context_parallelism_composes_with_fsdp_and_tensor_parallelism(cp4, case, dims):
    """CP 2 x FSDP 2 (two batches per step, FSDP sharding over all four ranks), CP 2 x TP 2, and CP 2 x HSDP 2 (two
    replicas, each sharding over its two CP ranks)."""
    result = cp4[case]
    _check_parity(result, 4)
    assert result["dims"].endswith(dims)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "case"),
    [
        ("cp2", "gpt_cp2_checkpointed"),
        ("cp2", "llama_cp2_checkpointed"),
        ("cp4", "gpt_cp4_checkpointed"),
        ("cp4", "llama_cp4_checkpointed"),
        ("cp4", "llama_cp2_tp2_checkpointed"),
    ],
)
def test_activation_checkpointing_recomputes_context_parallel_attention(world, case, request):
    """Each block recomputed in backward attends to every rank's keys again (the recomputation re-enters the
    interception): parity with one process, and twice the attention calls and key/value bytes of the run without
    checkpointing (2 layers x 3 steps, forward and recomputation)."""
    results = request.getfixturevalue(world)
    result = results[case]
    _check_parity(result, 2 if world == "cp2" else 4)
    plain = results[case.removesuffix("_checkpointed")]
    assert plain["attention_calls"] == 2 * 3
    assert result["attention_calls"] == 2 * plain["attention_calls"]
    assert result["kv_bytes_sent_rank0"] == 2 * plain["kv_bytes_sent_rank0"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "case"),
    [
        *(("cp2", f"{m}_cp2_per_rank{s}") for m in ("llama", "qwen3") for s in ("", "_ignore_index")),
        *(("cp4", f"{m}_cp4_per_rank{s}") for m in ("llama", "qwen3") for s in ("", "_ignore_index")),
        ("cp2", "llama_cp2_per_rank_checkpointed"),
        ("cp4", "llama_cp4_per_rank_checkpointed"),
        ("cp4", "llama_cp2_fsdp2_per_rank"),
        ("cp4", "llama_cp2_tp2_per_rank"),
    ],
)
def test_per_rank_loss_matches_one_process(world, case, request):
    """`context_parallel_loss="per_rank"`: each rank's own tokens through the final norm, the head and the causal
    LM's loss (labels shifted over the whole sequence before the split, the sum over the global count of valid
    tokens, all-reduced). Parity with one process, every rank logging the whole-sequence loss, at CP 2 and CP 4,
    with `ignore_index` runs falling unevenly between the ranks' parts, with activation checkpointing (twice the
    attention calls), and as CP 2 x FSDP 2 and CP 2 x TP 2 on 4 ranks."""
    results = request.getfixturevalue(world)
    _check_parity(results[case], 2 if world == "cp2" else 4)
    if case.endswith("_checkpointed"):
        assert results[case]["attention_calls"] == 2 * results[case.removesuffix("_checkpointed")]["attention_calls"]
    if "_cp2_" in case and world == "cp4":
        assert results[case]["dims"].endswith(
            "(data_shard 2 x context 2) x tensor_parallel 1"
            if "fsdp" in case
            else "(data_shard 1 x context 2) x tensor_parallel 2"
        )


ERRORS = {
    "sequence_not_divisible": r"does not divide by 2 x context_parallel_size",
    "size_not_dividing_world": r"`context_parallel_size=\d` does not divide the ranks",
    "padding_mask": r"`attention_mask` masks some tokens",
    "eager_attention": r"\(LlamaForCausalLM\) uses attn_implementation='eager'",
    "manual_attention": r"Block 'model.blocks.0' \(\w*Block\) ran under context parallelism without calling",
    "family_without_sdpa": r"\(Gemma2ForCausalLM\) uses attn_implementation=.* transformers has no SDPA attention",
    "checkpointing_around_the_blocks": r"`activation_checkpointing` selects 'model', which encloses the blocks",
    "router_loss": r"\(Qwen3MoeForCausalLM\) adds its router's load-balancing loss",
    "per_rank_not_a_causal_lm": r"`context_parallel_loss='per_rank'` computes the loss .* GPTModule holds none",
    "per_rank_without_labels": r"Module 'net' \(LlamaForCausalLM\) was called without `labels`",
    "per_rank_logits_read": r"`outputs.logits` is not available under `context_parallel_loss='per_rank'`",
}


@pytest.mark.slow
@pytest.mark.parametrize("world", ["cp2", "cp4"])
@pytest.mark.parametrize("name", sorted(ERRORS))
def test_each_refusal_is_raised_alike_on_every_rank(world, name, request):
    import re

    messages = request.getfixturevalue(world)[f"error_{name}"]
    assert all(m is not None and re.search(ERRORS[name], m) for m in messages), messages
    assert len(set(messages)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_activation_memory_per_rank_falls_with_the_context_parallel_size(cp2, cp4, model):
    """2 x 512 tokens per batch, FSDP over every rank: each rank's measured activations shrink with CP (the blocks'
    share divides by CP; the embedding's output, the logits and the loss stay whole), and the CP 2 and CP 1 runs on 2
    ranks measure what they measure on 4."""
    retained = {cp: cp4[f"memory_{model}_cp{cp}"]["retained"] for cp in (1, 2, 4)}
    assert all(len(set(values)) == 1 for values in retained.values())  # every rank alike
    assert retained[4][0] < 0.75 * retained[2][0] < 0.75 * retained[1][0]
    for cp in (1, 2):
        assert cp2[f"memory_{model}_cp{cp}"]["retained"][0] == retained[cp][0]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "cp"), [("cp2", 2), ("cp4", 2), ("cp4", 4)])
def test_per_rank_loss_keeps_no_whole_sequence_logits(world, cp, request):
    """The Llama of the memory table (2 x 512 tokens, FSDP over every rank) with `context_parallel_loss="per_rank"`:
    the final norm's input, the logits and the loss's saved tensors are this rank's part, so each rank retains less
    than with the head on the whole sequence, by what the dry run's estimate says; and the estimate (which traces
    the per-rank head and loss) equals the measurement plus the CPU-only causal masks, as in whole mode."""
    from lightning_dpar.context_parallel import cpu_mask_bytes

    results = request.getfixturevalue(world)
    per_rank, whole = results[f"memory_llama_cp{cp}_per_rank"], results[f"memory_llama_cp{cp}"]
    assert len(set(per_rank["retained"])) == 1  # every rank alike
    saved = whole["retained"][0] - per_rank["retained"][0]
    assert saved > 0.05 * whole["retained"][0]
    assert abs(saved - (whole["estimated"]["retained"] - per_rank["estimated"]["retained"])) <= 64
    masks = 2 * cpu_mask_bytes(512, cp)
    assert abs(per_rank["estimated"]["retained"] + masks - per_rank["retained"][0]) <= 64
    assert 0.75 <= per_rank["estimated"]["peak"] / per_rank["peak"][0] <= 1.25


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_activation_estimate_traces_one_context_parallel_rank(cp4, cp):
    """The `plan` dry run's estimate (one rank's step traced on fake tensors with the same split and exchange) against
    the measurement. The estimate prices attention as CUDA's kernels run it, with no mask; on CPU each attention
    layer also keeps its chunks' causal masks (`cpu_mask_bytes`), which is all that separates the two for the
    example GPT (to the loss's 8 bytes). The Llama's retained bytes likewise, CP 1 included (on fake tensors
    transformers would build a causal mask that training does not: the trace makes it answer as on real ones), its
    peak within the estimate's 25% bound."""
    from lightning_dpar.context_parallel import cpu_mask_bytes

    masks = 2 * cpu_mask_bytes(512, cp) if cp > 1 else 0  # 2 layers
    gpt = cp4[f"memory_gpt_cp{cp}"]
    for what in ("retained", "peak"):
        assert abs(gpt["estimated"][what] + masks - gpt[what][0]) <= 64, what
    llama = cp4[f"memory_llama_cp{cp}"]
    assert abs(llama["estimated"]["retained"] + masks - llama["retained"][0]) <= 64
    assert 0.75 <= llama["estimated"]["peak"] / llama["peak"][0] <= 1.25


@pytest.mark.slow
@pytest.mark.parametrize("world", ["cp2", "cp4"])
def test_the_activation_estimate_traces_the_context_parallel_recomputation(world, request):
    """The example GPT with its blocks checkpointed under CP over every rank: the blocks keep only their inputs, so
    far less is retained than without checkpointing, and the estimate (which recomputes each block in backward
    through the same `context_fn`) matches the measurement as it does without checkpointing."""
    size = 2 if world == "cp2" else 4
    results = request.getfixturevalue(world)
    checkpointed, plain = results[f"memory_gpt_cp{size}_checkpointed"], results[f"memory_gpt_cp{size}"]
    assert len(set(checkpointed["retained"])) == 1
    assert checkpointed["retained"][0] < 0.4 * plain["retained"][0]
    for what in ("retained", "peak"):  # to the loss's 8 bytes; no mask outlives a recomputed block's backward
        assert abs(checkpointed["estimated"][what] - checkpointed[what][0]) <= 64, what


@pytest.mark.slow
@pytest.mark.parametrize(("world", "size"), [("cp2", 2), ("cp4", 4)])
def test_the_exchange_sends_each_rank_s_keys_and_values_once_to_every_other_rank(world, size, request):
    """The bytes the key/value all-gather sent in forward, counted where it sends them, against the formula: per
    attention layer and step, keys and values, this rank's tokens to each of the `size - 1` others (the tiny Llama:
    batch 4, 2 key/value heads of dim 8, fp32, 2 layers, 3 steps)."""
    from lightning_dpar.context_parallel import key_value_sends

    gathered, _ = key_value_sends(16, size)
    per_token = 4 * 2 * 8 * 4  # batch x key/value heads x head dim x fp32 bytes
    expected = 2 * 2 * 3 * gathered[0] * per_token  # keys and values x layers x steps
    assert request.getfixturevalue(world)[f"llama_cp{size}"]["kv_bytes_sent_rank0"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("world", ["cp2", "cp4"])
def test_checkpoints_reshard_between_context_parallel_sizes_and_to_runs_without(world, request):
    """Saved with CP over every rank, resumed without CP, (on 4 ranks) with CP 2 x FSDP 2, and with CP again: the
    model and optimizer state come through each load exactly."""
    result = request.getfixturevalue(world)["checkpoint_between_layouts"]
    assert result["max_diffs"] == [0.0] * (len(result["layouts"]) - 1)
    assert result["keys"] > 20


@pytest.mark.slow
@pytest.mark.parametrize("world", ["cp2", "cp4"])
@pytest.mark.parametrize("case", ["validation_after_fit", "per_rank_validation_after_fit"])
def test_validation_splits_the_sequence_and_logs_the_global_loss(world, case, request):
    result = request.getfixturevalue(world)[case]
    assert result["val_loss"] == pytest.approx(result["want"], abs=ATOL)
    assert result["kv_bytes_sent_rank0"] > 0
