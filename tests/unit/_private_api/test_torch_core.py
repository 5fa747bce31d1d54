"""torch's private names outside `torch.distributed` (`lightning_dpar._private_api.torch_core`), each checked for
what the package relies on it to do: a torch upgrade that moves or changes one fails here first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar._private_api.torch_core import (
    compiled_autograd,
    grouped_mm,
    muon_init_group,
    privateuse1_backend_name,
    replace_muon_group_step,
    storage_key,
    swap_ddp_optimize_mode,
    swapped_parameters,
    view_base,
)


def test_grouped_mm_multiplies_each_group_of_rows_by_its_own_weight():
    mm = grouped_mm()
    if mm is None:
        pytest.skip("this torch has no grouped matmul")
    torch.manual_seed(0)
    x, weights = torch.randn(6, 8), torch.randn(2, 8, 4)
    out = mm(x, weights, offs=torch.tensor([2, 6], dtype=torch.int32))
    torch.testing.assert_close(out, torch.cat([x[:2] @ weights[0], x[2:] @ weights[1]]))


def test_swapped_parameters_are_seen_by_forward_and_the_originals_come_back_even_after_an_error():
    linear = nn.Linear(2, 2)
    weight, bias = linear.weight, linear.bias
    with swapped_parameters(linear, {"weight": torch.eye(2), "bias": torch.zeros(2)}):
        assert torch.equal(linear(torch.tensor([[3.0, 4.0]])), torch.tensor([[3.0, 4.0]]))
    assert linear.weight is weight and linear.bias is bias
    with pytest.raises(RuntimeError), swapped_parameters(linear, {"weight": torch.zeros(2, 2)}):
        raise RuntimeError
    assert linear.weight is weight


def test_privateuse1_backend_name_is_torchs_default_without_an_out_of_tree_backend():
    assert privateuse1_backend_name() == "privateuseone"


def test_compiled_autograd_hands_each_backward_graph_to_the_compiler():
    graphs = []

    def compiler(graph_module):
        graphs.append(graph_module)
        return graph_module

    x = torch.randn(3, 4, requires_grad=True)
    with compiled_autograd(compiler):
        (x.sin() * 2).sum().backward()
    assert len(graphs) == 1 and isinstance(graphs[0], torch.fx.GraphModule)
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_swap_ddp_optimize_mode_returns_the_previous_mode():
    previous = swap_ddp_optimize_mode("python_reducer")
    try:
        assert torch._dynamo.config.optimize_ddp == "python_reducer"
        assert swap_ddp_optimize_mode(previous) == "python_reducer"
    finally:
        torch._dynamo.config.optimize_ddp = previous
    assert torch._dynamo.config.optimize_ddp == previous


def test_view_base_tells_a_recorded_view_from_a_tensor_of_its_own():
    base = torch.randn(4, 4)
    assert view_base(base[1]) is base
    assert view_base(base) is None and view_base(base.clone()) is None


def test_storage_key_is_shared_by_views_and_differs_between_storages():
    base = torch.zeros(8)
    assert storage_key(base[2:].untyped_storage()) == storage_key(base.view(2, 4).untyped_storage())
    assert storage_key(base.untyped_storage()) != storage_key(torch.zeros(8).untyped_storage())


def test_a_replaced_muon_group_step_is_what_step_calls_and_torchs_own_gives_muons_update():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, reference):
        p.grad = torch.randn(4, 3)
        r.grad = p.grad.clone()
    optimizer, plain = torch.optim.Muon(params, lr=0.1), torch.optim.Muon(reference, lr=0.1)
    calls = []

    def group_step(group, group_params, grads, buffers):
        calls.append(len(group["params"]))
        return muon_init_group(optimizer, group, group_params, grads, buffers)

    replace_muon_group_step(optimizer, group_step)
    optimizer.step()
    plain.step()
    assert calls == [2]
    for p, r in zip(params, reference):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
        assert not torch.equal(p.detach(), r.grad)  # it did move
