"""`lightning_dpar.estimates.tensor_parallel_trace`: the split flags a tensor-parallel style's layouts give the tensors
of a traced step, on a module run on real CPU tensors with a recorder of flags. Whole traces under tensor
parallelism: `tests/unit/estimates/test_activations.py`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from lightning_dpar.estimates.tensor_parallel_trace import Redistribution, hook_style


class _Flags:
    """The split flag of each tensor marked, by identity (what the trace's recorder keeps per storage)."""

    def __init__(self) -> None:
        self.split: dict[int, bool] = {}

    def mark(self, tensor: torch.Tensor, split: bool) -> None:
        self.split[id(tensor)] = split


def _run(module: nn.Module, style: ParallelStyle, x: torch.Tensor) -> tuple[_Flags, torch.Tensor, bool]:
    flags = _Flags()
    known = hook_style(module, style, Redistribution(flags))
    return flags, module(x), known


def test_a_colwise_linear_output_is_split_and_a_gathered_one_is_a_new_whole_tensor():
    flags, out, known = _run(nn.Linear(4, 6), ColwiseParallel(), torch.ones(2, 4))
    assert known and flags.split[id(out)] is True
    flags, out, _ = _run(nn.Linear(4, 6), ColwiseParallel(output_layouts=Replicate()), torch.ones(2, 4))
    # The local output is marked split, then all-gathered into a new tensor marked whole.
    assert sorted(flags.split.values()) == [False, True] and flags.split[id(out)] is False


def test_a_rowwise_linear_output_is_partial_then_all_reduced_into_a_whole_tensor():
    flags, out, _ = _run(nn.Linear(6, 4), RowwiseParallel(), torch.ones(2, 6))
    assert flags.split[id(out)] is False


def test_a_sharding_redistribution_clones_and_marks_split_and_a_noop_one_keeps_the_tensor():
    flags = _Flags()
    redistribute = Redistribution(flags)
    x = torch.ones(2, 4)
    assert redistribute(x, Replicate(), Replicate()) is x
    assert redistribute(x, Replicate(), None) is x
    chunk = redistribute(x, Replicate(), Shard(1))
    assert chunk is not x and flags.split[id(chunk)] is True


def test_a_prepared_input_is_redistributed_and_an_unknown_style_is_reported():
    flags = _Flags()
    module = nn.Identity()
    style = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(0),))
    assert hook_style(module, style, Redistribution(flags))
    x = torch.ones(2, 4)
    out = module(x)
    assert out is not x and flags.split[id(out)] is True

    class _Unknown(ParallelStyle):
        def _apply(self, module, device_mesh):
            return module

    assert not hook_style(nn.Linear(2, 2), _Unknown(), Redistribution(flags))
