"""Memory features on 4 gloo ranks through real Trainers (one launch): activation checkpointing, CPU offload,
`reshard_after_forward` and bf16 mixed precision each do what they claim, without changing the training result."""

from __future__ import annotations

import pytest

from tests.conftest import run_workers

STEPS = 3


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    return run_workers(4, "memory", tmp_path_factory.mktemp("memory"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "replicate", "2d"])
def test_activation_checkpointing_recomputes_and_keeps_gradients(memory, strategy):
    off, on, by_class = (memory[f"ac_{strategy}_{label}"] for label in ("off", "on", "by_class"))
    assert off["fc1_calls"] == STEPS  # one forward per step
    assert on["fc1_calls"] == by_class["fc1_calls"] == 2 * STEPS  # forward + recomputation in backward
    # Inside checkpointed blocks nothing is saved for backward: less activation memory.
    assert on["saved_numel"] == by_class["saved_numel"] < off["saved_numel"] / 2
    assert on["max_diff_to_no_ac"] == by_class["max_diff_to_no_ac"] == 0.0


@pytest.mark.slow
def test_cpu_offload_keeps_state_on_cpu_with_parity(memory):
    offload = memory["offload"]
    # On a CPU-only machine the device checks hold trivially; `every_param_offloaded` (FSDP2's own record of the
    # CPUOffloadPolicy) is what distinguishes offload there. On GPU the device checks are the real proof.
    assert offload["every_param_offloaded"]
    assert offload["param_devices"] == offload["grad_devices"] == offload["optimizer_state_devices"] == ["cpu"]
    assert offload["max_diff_to_no_offload"] == 0.0


@pytest.mark.slow
def test_reshard_after_forward_as_fsdp2_defines_it(memory):
    # True: only this rank's 1/4 shard stays registered after the block's forward.
    assert memory["reshard_True"]["dtensor"] and memory["reshard_True"]["local_fraction"] == 0.25
    # False: the full (unsharded) parameter stays registered for backward.
    assert not memory["reshard_False"]["dtensor"] and memory["reshard_False"]["local_fraction"] == 1.0
    # 2: resharded to groups of 2 ranks, so each keeps half.
    assert memory["reshard_2"]["dtensor"] and memory["reshard_2"]["local_fraction"] == 0.5
    assert memory["reshard_False"]["max_diff_to_reshard_true"] == 0.0
    assert memory["reshard_2"]["max_diff_to_reshard_true"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "replicate", "2d"])
def test_bf16_mixed_computes_in_bf16_keeps_fp32_master_and_reduction(memory, strategy):
    case = memory[f"bf16_{strategy}"]
    assert case["compute"]["input"] == case["compute"]["output"] == "torch.bfloat16"
    assert case["fp32_compute"]["output"] == "torch.float32"
    assert case["param_dtypes"] == case["grad_dtypes"] == ["torch.float32"]
    collectives = case["collective_dtypes"]
    if strategy == "replicate":  # DDP all-reduces the fp32 gradients of autocast training
        assert "torch.bfloat16" not in collectives["allreduce_"]
    else:  # FSDP2's MixedPrecisionPolicy: all-gather in bf16, reduce-scatter in fp32
        assert collectives["_allgather_base_"] == ["torch.bfloat16"]
        assert collectives["_reduce_scatter_base_"] == ["torch.float32"]
    # bf16 has 8 mantissa bits: 3 SGD steps move parameters by ~3.6e-4 from fp32 training (measured); a gradient
    # averaging bug moves them by >= 1.7e-2 (see tests/launched/test_precision.py), so 1.5e-3 separates the two.
    assert 1e-5 < case["max_diff_to_fp32"] < 1.5e-3
