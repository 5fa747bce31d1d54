"""Lightning callbacks refused before any collective where they cannot run
(`lightning_dpar.conformance.callback_checks`),
in-process: `ModelPruning` on shards, `BackboneFinetuning` under tensor parallelism. The same refusals through real
Trainers are the conformance matrix's callback rows (cases in `tests/workers/conformance_callbacks.py`, the matrix in
`tests/launched/test_conformance_callbacks.py`)."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning

from lightning_dpar.conformance.callback_checks import refuse_unsupported_callbacks


@pytest.mark.parametrize("whole_parameters", [True, False])
def test_model_pruning_refused_where_parameters_are_shards(whole_parameters):
    callbacks = [ModelPruning("l1_unstructured", amount=0.3)]
    if whole_parameters:
        refuse_unsupported_callbacks(callbacks, "ReplicateStrategy", whole_parameters=True, tensor_parallel=1)
    else:
        with pytest.raises(ValueError, match=r"ModelPruning cannot prune under FullyShardStrategy.*dpar_replicate"):
            refuse_unsupported_callbacks(callbacks, "FullyShardStrategy", whole_parameters=False, tensor_parallel=1)


class IdentityFinetuning(BackboneFinetuning):
    @staticmethod
    def filter_on_optimizer(optimizer, params):
        return [p for p in params if not any(p is q for group in optimizer.param_groups for q in group["params"])]


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_finetuning_refused_with_tensor_parallelism(tensor_parallel):
    callbacks = [BackboneFinetuning()]
    refuse_unsupported_callbacks([IdentityFinetuning()], "FSDPTensorParallelStrategy", False, tensor_parallel=2)
    if tensor_parallel == 1:
        refuse_unsupported_callbacks(callbacks, "FullyShardStrategy", whole_parameters=False, tensor_parallel=1)
    else:
        with pytest.raises(ValueError, match=r"BackboneFinetuning cannot unfreeze .*tensor_parallel_size=2.*identity"):
            refuse_unsupported_callbacks(
                callbacks, "FSDPTensorParallelStrategy", whole_parameters=False, tensor_parallel=2
            )
