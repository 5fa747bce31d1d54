"""How error messages name a class: qualified by its module (`peft.tuners.lora.layer.Linear`), never bare.

A bare name can contradict the message it stands in: peft's LoRA wrapper of a `torch.nn.Linear` is also called
`Linear`, so "cannot shard 'q_proj' (Linear): it supports Linear only" said nothing. A leaf module: it imports
nothing of the package.
"""

from __future__ import annotations

__all__ = ["class_name"]


def class_name(obj: object) -> str:
    """The qualified name of `obj`'s class (of `obj` itself if it is a class): `module.QualName`; builtins bare."""
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
