"""Ranks agree on a problem before a collective: the one rule every save and load follows so that a failure on one
rank raises the same error on every rank instead of leaving the others waiting in a collective it never joins."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["first_problem"]


def first_problem(problem: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """Every rank's `problem` (None: all is well) is shared over `group`; return the first rank's problem, the same
    on every rank. A collective: every rank of `group` must call it, with or without a problem."""
    if not dist.is_initialized():
        return problem
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p is not None), None)
