"""LitGPT `GPT` models through real Trainers on 2 and 4 gloo ranks: meta-device init materialised shard by shard
equals building the model normally on CPU with the same seed (skipped without `litgpt`; it is not in CI's extras
because its `huggingface_hub<1.4` pin conflicts with transformers 5, see docs/ordinary-models.md)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("litgpt")

import lightning_dpar
from lightning_dpar.estimates import plan
from tests.conftest import run_workers
from tests.workers.litgpt_models import MLP_TP_PLAN, LitGPTModule

CASES = ["litgpt_replicate", "litgpt_meta_init_fsdp", "litgpt_meta_init_2d_mlp_tp"]


@pytest.fixture(scope="module", params=[2, 4])
def results(request, tmp_path_factory):
    return run_workers(request.param, "litgpt", tmp_path_factory.mktemp(f"litgpt{request.param}"))


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
