"""The bundled example that `python -m lightning_dpar fit` trains: a small GPT-style byte-level decoder
(`gpt.GPT`) on the Python standard library's own source files (`stdlib_data.StdlibBytes`).

It lives inside the package (not only under the repo's `examples/`) so the default job runs from any install.
"""

from lightning_dpar.examples.gpt import GPT, Decoder
from lightning_dpar.examples.stdlib_data import StdlibBytes

__all__ = ["GPT", "Decoder", "StdlibBytes"]
