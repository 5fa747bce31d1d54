"""The layout search's window on the dry run (`lightning_dpar.layout_search.probe`): the model it prices is the one
training builds, the layers a LightningModule builds in `configure_model` included."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dpar.layout_search.probe import search_model
from lightning_dpar.layout_search.profiles import get_profile
from tests.support.hf_configs import decoder_config

CONTEXT = 128


class LlamaBuiltInConfigureModel(L.LightningModule):
    """A tiny transformers Llama built in `configure_model` (idempotently, as Lightning asks of the hook), as
    `examples/finetune/llama_module.py` builds its model: before that hook the module holds no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM(decoder_config(max_position_embeddings=CONTEXT))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def test_a_model_built_in_configure_model_is_searched_as_built():
    pytest.importorskip("transformers")
    module = LlamaBuiltInConfigureModel()
    result = search_model(module, 2, 1, get_profile("cpu-gloo"), batch_size=1)  # no pipeline layout to dry-run
    with torch.device("meta"):
        built = LlamaBuiltInConfigureModel()
        built.configure_model()
    # Before, the search read the empty module: 0 parameters, 1 layer, and no context length to default to.
    assert result.facts.params == sum(p.numel() for p in built.parameters()) > 0
    assert (result.facts.layers, result.facts.hidden, result.facts.seq_len) == (2, 32, CONTEXT)
    assert result.best is not None and len({e.layout.dims for e in result.ranked}) > 1
    assert module.model is None  # the caller's module is left as it was: the search builds on its meta copy


@pytest.mark.parametrize("pipeline", [1, 2])
def test_each_layouts_activations_are_the_dry_runs_estimate_of_that_layout(pipeline):
    """The search prices activations with the dry run's own estimate: for a layout, each pipeline rank's peak with
    and without checkpointing is what `plan --batch-size --seq-len` reports for the same strategy."""
    from lightning_dpar import FSDPTensorParallelStrategy
    from lightning_dpar.estimates import plan
    from lightning_dpar.examples import GPT
    from lightning_dpar.layout_search.candidates import Layout
    from lightning_dpar.layout_search.probe import dry_run_probe, token_batch
    from lightning_dpar.optim.precision import DparPrecision
    from lightning_dpar.parallel_dims import ParallelDims

    def gpt():
        with torch.device("meta"):
            return GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)

    dims = ParallelDims.resolve(4, 4, 2, pipeline_parallel_size=pipeline)
    layout = Layout(dims, schedule="1F1B" if pipeline > 1 else None, microbatches=4 if pipeline > 1 else 1)
    batch = token_batch(8, 32)
    priced = dry_run_probe(gpt, 4, 1, batch=batch)(layout)
    strategy = FSDPTensorParallelStrategy(**layout.strategy_kwargs())
    strategy.precision_plugin = DparPrecision("32-true")
    reported = plan(strategy, gpt(), 4, batch=batch).activations
    assert len(priced.ranks) == pipeline
    for rank, memory in enumerate(priced.ranks):
        assert memory.activations == reported.peak(rank, checkpointing=False)
        assert memory.activations_checkpointed == reported.peak(rank, checkpointing=True)
        assert memory.activations_selective == reported.peak(rank, checkpointing="selective")
        assert memory.activations_checkpointed < memory.activations_selective < memory.activations
    flops = reported.flops
    assert priced.selective_share == flops.recomputed("selective") / flops.recomputed(True)
    assert 0 < priced.selective_share < 1


def test_the_sequence_length_is_read_off_a_module_when_the_hparams_lack_it():
    """A subclass's hparams are its own arguments (LightningCLI records only those): the decoder says its length."""
    import lightning as L

    from lightning_dpar.examples.gpt import Decoder
    from lightning_dpar.layout_search.probe import default_seq_len

    class Wrapper(L.LightningModule):
        def __init__(self, width: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = Decoder(64, 12, 1, 2, width, 0, 2, False)

    wrapper = Wrapper()
    assert "block_size" not in wrapper.hparams
    assert default_seq_len(wrapper) == 12
