"""torchao's private names the package relies on (float8 training, the `float8` extra): imported only when a run
asks for float8, since importing torchao costs seconds. Checked on torchao 0.18.0 with torch 2.13 and on the floor
the extra admits with torch 2.11; each says why it is needed."""

from __future__ import annotations

from typing import Any

__all__ = ["float8_linear_class"]


def float8_linear_class() -> type[Any]:
    """torchao's `Float8Linear` (`torchao.float8.float8_linear`), the module `convert_to_float8_training` swaps an
    `nn.Linear` for. torchao documents it as not public (`torchao.float8.__all__` leaves it out: "Float8Linear [is]
    not [a] public API"), and has no public predicate for a converted module; the package needs one to say which
    modules a run converted (the plan's `float8` slice, checked after the conversion) and to refuse a model that
    was converted already by the user."""
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear
