"""The expert-parallel dispatch in-process, on a one-rank gloo group (`lightning_dpar.experts.parallel`): tokens
sorted to their experts, the module's own forward on them, results back in token order and weighted, gradients
through both exchanges. Several ranks (uneven splits, idle experts) are in `tests/launched/test_moe.py`."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from lightning_dpar.examples.moe import Experts, Router
from lightning_dpar.experts.parallel import ExpertDispatch, ScaleGradient, local_expert_range


def test_dispatch_equals_the_modules_own_forward_with_gradients(gloo_world):
    torch.manual_seed(0)
    experts, router = Experts(8, 4), Router(8, 4, 2)
    tokens = torch.randn(10, 8, requires_grad=True)
    chosen, weights = router(tokens)
    want = experts(tokens, chosen, weights)
    want.square().sum().backward()
    want_grads = [tokens.grad.clone(), experts.fc.grad.clone(), router.score.weight.grad.clone()]
    for tensor in (tokens, experts.fc, router.score.weight):
        tensor.grad = None

    dispatch = ExpertDispatch(experts, init_device_mesh("cpu", (1,)))
    got = dispatch(tokens, *router(tokens))
    got.square().sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    got_grads = [tokens.grad, experts.fc.grad, router.score.weight.grad]
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got_grads, want_grads))
    assert experts.num_experts == 4  # restored after the local call


def test_no_token_still_gives_every_expert_a_zero_gradient(gloo_world):
    experts = Experts(8, 4)
    dispatch = ExpertDispatch(experts, init_device_mesh("cpu", (1,)))
    out = dispatch(torch.randn(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    out.sum().backward()
    assert out.shape == (0, 8)
    assert torch.equal(experts.fc.grad, torch.zeros_like(experts.fc))


def test_scale_gradient_is_the_identity_forward():
    x = torch.ones(3, requires_grad=True)
    y = ScaleGradient.apply(x, 0.25)
    y.sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.full((3,), 0.25))


def test_local_experts_are_contiguous_blocks():
    assert [list(local_expert_range(8, rank, 4)) for rank in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_router_loss_gathers_rows_keeping_this_ranks_gradient(gloo_world):
    import torch.distributed as dist

    from lightning_dpar.experts.router_loss import GlobalRouterLoss, gather_rows

    local = torch.randn(3, 4, requires_grad=True)
    gathered = gather_rows(local, dist.group.WORLD)
    gathered.sum().backward()
    assert torch.equal(gathered, local) and torch.equal(local.grad, torch.ones(3, 4))
    # One data-parallel rank: nothing to change.
    assert not GlobalRouterLoss(torch.nn.Linear(2, 2), dist.group.WORLD).applies


def test_grouped_experts_equal_the_loop():
    """The GPU preset's grouped matmuls (`torch._grouped_mm`, fp32 on CPU) compute what the loop computes, gradients
    included, with an expert no token chose."""
    torch.manual_seed(0)
    loop, grouped = Experts(8, 4), Experts(8, 4, grouped=True)
    grouped.load_state_dict(loop.state_dict())
    tokens = torch.randn(10, 8)
    chosen = torch.randint(0, 3, (10, 2))  # expert 3: no token
    weights = torch.rand(10, 2)
    outputs = [experts(tokens, chosen, weights) for experts in (loop, grouped)]
    for out in outputs:
        out.square().sum().backward()
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)
    assert torch.allclose(loop.fc.grad, grouped.fc.grad, atol=1e-6)
    assert torch.equal(grouped.proj.grad[3], torch.zeros_like(grouped.proj.grad[3]))


def test_grouped_experts_take_zero_rows():
    experts = Experts(8, 4, grouped=True)
    out = experts(torch.randn(0, 8), torch.zeros(0, 1, dtype=torch.long), torch.ones(0, 1))
    assert out.shape == (0, 8)
