"""LitGPT `GPT` models through real Trainers and real Fabric loops on 2 and 4 gloo ranks: meta-device init
materialised shard by shard equals building the model normally on CPU with the same seed; a Fabric loop shaped like
LitGPT's pretraining script trains under `dpar_fsdp` and `dpar_2d` (MLP tensor parallelism) like one process, and
a plan splitting LitGPT's fused `qkv` column-wise is refused by name. Skipped without `litgpt`, which is no extra
(its `huggingface_hub<1.4` pin conflicts with transformers 5, see docs/ordinary-models.md): CI installs it without
its dependencies into a directory of its own on `PYTHONPATH`, so these run there."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("litgpt")

import lightning_dpar
from lightning_dpar.estimates import plan
from tests.workers.litgpt_models import MLP_TP_PLAN, LitGPTModule

CASES = ["litgpt_replicate", "litgpt_meta_init_fsdp", "litgpt_meta_init_2d_mlp_tp"]


SHARED_LAUNCH = {2: "litgpt,litgpt_fabric", 4: "litgpt,litgpt_fabric"}


@pytest.fixture(scope="module", params=[2, 4])
def results(request, shared_launch):
    """The Trainer and Fabric cases in the suite's shared launch of each world size (a launch's start costs more than
    its cases)."""
    return shared_launch(request.param)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["litgpt_fabric_fsdp", "litgpt_fabric_2d"])
def test_litgpt_pretraining_loop_under_fabric_matches_one_process(results, case):
    result = results[case]
    assert result["max_abs_diff"] < 1e-5
    assert result["steps"] == 3  # optimizer steps, each over accumulated micro-batches


@pytest.mark.slow
def test_litgpt_fused_qkv_split_is_refused_on_every_rank_with_the_mlp_plan_as_fix(results):
    messages = results["litgpt_fabric_refuses_fused_qkv_split"]
    assert len(set(messages)) == 1 and messages[0] is not None, messages
    assert "splits 'transformer.h.0.attn.qkv' column-wise, but it is a fused q/k/v projection" in messages[0]
    assert "litgpt.model.CausalSelfAttention" in messages[0]
    assert "`transformer.h.*.mlp.fc_[12]` colwise" in messages[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_litgpt_matches_single_process_training_from_a_normal_cpu_build(results, case):
    assert results[case]["max_abs_diff"] < 1e-5


def test_plan_dry_run_of_litgpt_never_materialises():
    with torch.device("meta"):
        module = LitGPTModule()
    strategy = lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=MLP_TP_PLAN)
    text = plan(strategy, module, world_size=4).render()
    assert "net.transformer.h.*.mlp.proj" in text and "TP RowwiseParallel" in text
    assert all(t.is_meta for t in [*module.parameters(), *module.buffers()])
