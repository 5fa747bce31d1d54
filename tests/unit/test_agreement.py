"""`first_problem`: every rank gets the first rank's problem, so all raise the same error or none does."""

from __future__ import annotations

from lightning_dpar.agreement import first_problem


def test_without_a_process_group_the_problem_is_returned_as_it_is():
    assert first_problem(None) is None
    assert first_problem("disk full") == "disk full"


def test_on_a_real_group_the_problem_goes_through_the_gather(gloo_world):
    import torch.distributed as dist

    assert first_problem(None) is None
    assert first_problem("rank 0: no such file") == "rank 0: no such file"
    assert first_problem("on a subgroup", group=dist.new_group([0])) == "on a subgroup"
