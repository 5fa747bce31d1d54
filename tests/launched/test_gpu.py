"""The core guarantees on a GPU: NCCL, world size 1, fp32 parity and bf16 precision through a real Trainer.

Run where a CUDA device exists (`python -m pytest -m gpu`); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_workers
from tests.launched.test_parity import ATOL, PARITY_CASES
from tests.launched.test_precision import BF16_ATOL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def gpu1(tmp_path_factory):
    # TF32 matmuls would round fp32 parity far beyond ATOL; the tests compare true fp32 training.
    env = {"DPAR_TEST_ACCELERATOR": "cuda", "NVIDIA_TF32_OVERRIDE": "0"}
    return run_workers(1, "2d,fsdp,replicate,precision", tmp_path_factory.mktemp("gpu1"), extra_env=env)


# One GPU means world size 1: the `2d_*` cases run `FSDPTensorParallelStrategy` with a tensor-parallel size of 1,
# so they prove its code path on NCCL, not tensor parallelism across GPUs (the CPU tests do that on 2 and 4 ranks).
@pytest.mark.parametrize("case", PARITY_CASES)
def test_nccl_world_1_parity(gpu1, case):
    assert gpu1[case]["max_abs_diff"] < ATOL


@pytest.mark.parametrize("strategy", ["2d", "fsdp", "replicate"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_gpu(gpu1, strategy, precision):
    seen = gpu1[f"precision_{strategy}_{precision}"]
    assert seen["backend"] == "nccl"
    assert seen["activation"] == ["bfloat16"]
    expected = ["float32"] if precision == "bf16-mixed" else ["bfloat16"]
    assert seen["params"] == seen["grads"] == expected
    assert seen["max_abs_diff"] < BF16_ATOL[precision]
