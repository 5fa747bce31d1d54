"""The loss on each context-parallel rank's own tokens (`lightning_dpar.context_parallel.loss`), in process: the
labels shifted over the whole sequence before the split, every rank's part of the loss over the global denominator
summing to transformers' `ForCausalLMLoss`, the backward's factor, the causal LM found in the plan, the strategy
option (constructor and LightningCLI YAML), and each refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.context_parallel import HeadTailLayout
from lightning_dpar.context_parallel.loss import (
    PartialLogits,
    causal_lm_loss_module,
    check_labels,
    check_loss_mode,
    per_rank_loss,
    shifted_labels,
    sum_over_ranks,
)
from lightning_dpar.parallel_dims import ParallelDims

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

VOCAB = 11


def _labels(seq_len: int = 16, ignored: bool = False) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (3, seq_len), generator=torch.Generator().manual_seed(0))
    if ignored:  # runs of ignored tokens mostly in the head: the ranks' parts hold different numbers of valid ones
        labels[0, 1:9] = labels[1, 0:5] = labels[2, 12:] = -100
    return labels


def test_the_labels_are_shifted_over_the_whole_sequence_before_each_rank_takes_its_part():
    labels = torch.arange(16).expand(2, 16)
    shifted = shifted_labels(labels)
    assert shifted[0].tolist() == [*range(1, 16), -100]
    for size in (2, 4):
        parts = [HeadTailLayout(size, rank).take(shifted, -1) for rank in range(size)]
        assert torch.equal(HeadTailLayout(size, 0).assemble(parts, -1), shifted)
        chunk = 16 // (2 * size)
        # each part's targets are the next global positions: a chunk's last token keeps the next chunk's first
        for rank, part in enumerate(parts):
            positions = HeadTailLayout(size, rank).positions(16)
            want = torch.where(positions + 1 < 16, positions + 1, torch.tensor(-100))
            assert part[0].tolist() == want.tolist()
            assert part[0, chunk - 1] == (rank + 1) * chunk


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("ignored", [False, True])
@pytest.mark.parametrize("how", ["labels", "shift_labels", "num_items_in_batch"])
def test_the_ranks_parts_sum_to_the_whole_sequence_loss(size, ignored, how):
    """Each rank's part (group `None`: no all-reduce) over the global denominator; their sum is `ForCausalLMLoss` on
    the whole sequence, however unevenly the ignored tokens fall between the parts."""
    labels = _labels(ignored=ignored)
    logits = torch.randn(3, 16, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kwargs: dict = {}
    if how == "shift_labels":
        kwargs = {"shift_labels": shifted_labels(labels)}
    elif how == "num_items_in_batch":
        kwargs = {"num_items_in_batch": torch.tensor(40)}
    want = ForCausalLMLoss(logits, labels, VOCAB, **kwargs)
    parts = []
    for rank in range(size):
        layout = HeadTailLayout(size, rank)
        parts.append(per_rank_loss(layout.take(logits, 1), labels, VOCAB, layout, None, **kwargs))
    valid = [int((HeadTailLayout(size, r).take(shifted_labels(labels), -1) != -100).sum()) for r in range(size)]
    assert len(set(valid)) > 1 or not ignored  # the uneven case is uneven
    torch.testing.assert_close(sum(parts), want.float(), atol=1e-6, rtol=0)
    assert all(part.dtype == torch.float32 for part in parts)  # summed in fp32, as transformers' loss upcasts


def test_the_backward_multiplies_by_the_size_for_fsdps_average():
    part = torch.tensor(2.0, requires_grad=True)
    total = sum_over_ranks(part, None, 4)
    total.backward()
    assert total.item() == 2.0 and part.grad.item() == 4.0


def test_logits_that_do_not_cover_the_rank_s_tokens_are_refused():
    labels = _labels()
    with pytest.raises(
        ValueError, match=r"cover 1 tokens, where its part of the 16 labels is 8: .*\(no `logits_to_keep`\)"
    ):
        per_rank_loss(torch.randn(3, 1, VOCAB), labels, VOCAB, HeadTailLayout(2, 0), None)


def test_the_loss_mode_is_checked_when_the_strategy_is_made():
    assert check_loss_mode("per_rank") == "per_rank"
    with pytest.raises(
        ValueError, match=r"`context_parallel_loss='per-rank'` is invalid: use 'whole' .* or 'per_rank'"
    ):
        FullyShardStrategy(context_parallel_size=2, context_parallel_loss="per-rank")  # type: ignore[arg-type]
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2, context_parallel_loss="per_rank")
    assert strategy.plan_options.context_parallel_loss == "per_rank"
    assert FullyShardStrategy().plan_options.context_parallel_loss == "whole"


class Holder(nn.Module):
    """A LightningModule-like root holding a transformers causal LM."""

    def __init__(self, **config) -> None:
        super().__init__()
        from tests.support.hf_configs import decoder_config

        self.net = transformers.LlamaForCausalLM(decoder_config("LlamaConfig", vocab_size=VOCAB, **config))


def test_the_plan_names_the_causal_lm_whose_loss_is_per_rank():
    from lightning_dpar.parallel.parallelize import plan_modules

    with torch.device("meta"):
        root = Holder()
    dims = ParallelDims.resolve(4, 4, context_parallel_size=2)
    plan = plan_modules(root, dims, FullyShardStrategy(context_parallel_loss="per_rank").plan_options)
    assert plan.context_parallel_loss == "net"
    assert plan_modules(root, dims, FullyShardStrategy().plan_options).context_parallel_loss is None
    without_cp = ParallelDims.resolve(4, 4)
    assert (
        plan_modules(
            root, without_cp, FullyShardStrategy(context_parallel_loss="per_rank").plan_options
        ).context_parallel_loss
        is None
    )


def test_a_model_without_its_own_causal_lm_loss_is_refused():
    blocks = ["net.model.layers.0"]
    with torch.device("meta"):
        root = Holder()
    assert causal_lm_loss_module(root, blocks) == "net"
    root.net.loss_function = lambda **kwargs: None  # the user's own loss: its shift and average are unknown
    with pytest.raises(ValueError, match=r"Holder holds none around the blocks \['net.model.layers.0'\]"):
        causal_lm_loss_module(root, blocks)
    with pytest.raises(ValueError, match=r"Use `context_parallel_loss='whole'`"):
        causal_lm_loss_module(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])), ["0.0"])


def test_a_forward_without_labels_or_returning_a_tuple_is_refused():
    with torch.device("meta"):
        model = Holder().net
    ids = torch.zeros(1, 4, dtype=torch.long)
    check_labels(model, "Module 'net'", (), {"input_ids": ids, "labels": ids})
    check_labels(model, "Module 'net'", (ids, None, None, None, None, ids), {})
    with pytest.raises(ValueError, match=r"Module 'net' was called without `labels` .* use `outputs.loss`"):
        check_labels(model, "Module 'net'", (ids,), {})
    with pytest.raises(ValueError, match=r"Module 'net' was called with `return_dict=False` .* only this rank's"):
        check_labels(model, "Module 'net'", (), {"input_ids": ids, "labels": ids, "return_dict": False})


def test_partial_logits_raise_on_every_use():
    partial = PartialLogits((2, 8, VOCAB), 16, HeadTailLayout(2, 1))
    uses = [
        lambda: partial.argmax(-1),
        lambda: partial.shape,
        lambda: partial[:, -1],
        lambda: partial * 2,
        lambda: float(partial),
        lambda: torch.nn.functional.cross_entropy(partial, torch.zeros(2, dtype=torch.long)),
        lambda: torch.softmax(partial, -1),
    ]
    for use in uses:
        with pytest.raises(RuntimeError, match=r"its own 8 of the sequence's 16 tokens only \(two of its 4 chunks"):
            use()
    assert "outputs.loss" in repr(partial)


@pytest.mark.usefixtures("no_pytest_argv")
@pytest.mark.parametrize(
    "class_path", ["lightning_dpar.FullyShardStrategy", "lightning_dpar.FSDPTensorParallelStrategy"]
)
def test_context_parallel_loss_from_lightning_cli_yaml(tmp_path, class_path):
    import yaml
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    init_args = {"context_parallel_size": 2, "context_parallel_loss": "per_rank"}
    strategy = {"class_path": class_path, "init_args": init_args}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 1, "strategy": strategy}}))
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(path)], save_config_callback=None)
    assert cli.trainer.strategy.plan_options.context_parallel_loss == "per_rank"


@pytest.mark.parametrize("as_list", [False, True])
def test_the_activation_estimate_traces_the_per_rank_head_and_loss(as_list):
    """The dry run hands the estimate its plans as a list (one per pipeline rank): the per-rank loss survives that
    too. At CP 2 the head's and the loss's activations are halved, so the estimate is lower than in whole mode."""
    from lightning_dpar.estimates.activations import estimate_activations
    from lightning_dpar.parallel.parallelize import plan_modules

    class Trained(Holder):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(input_ids=batch, labels=batch).loss

    with torch.device("meta"):
        root = Trained(hidden_size=64, intermediate_size=128)
    dims = ParallelDims.resolve(2, 2, context_parallel_size=2)
    peaks = {}
    for loss in ("whole", "per_rank"):
        plan = plan_modules(root, dims, FullyShardStrategy(context_parallel_loss=loss).plan_options)
        estimate = estimate_activations(root, [plan] if as_list else plan, dims, (2, 64))
        peaks[loss] = estimate.rank(0).per_microbatch(False).retained
    assert peaks["per_rank"] < peaks["whole"]
