"""DDP communication hooks by name, import path or callable (`lightning_dpar.parallel.ddp_comm_hooks`), and the
compressed all-reduce's arithmetic on a one-rank gloo group. Compressed all-reduce through a 2-rank `ReplicateStrategy`
run is in the launched tests."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_dpar.parallel.ddp_comm_hooks import COMPRESS_HOOK_DTYPES, compressed_allreduce_hook, resolve_comm_hook


def test_a_hook_by_name_by_import_path_or_itself():
    assert resolve_comm_hook(None) is None
    assert resolve_comm_hook(default_hooks.allreduce_hook) is default_hooks.allreduce_hook
    path = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook"
    assert resolve_comm_hook(path) is default_hooks.fp16_compress_hook
    assert resolve_comm_hook("bf16_compress").__name__ == "bfloat16_compress_hook"
    assert resolve_comm_hook("fp16_compress").__name__ == "float16_compress_hook"


@pytest.mark.parametrize(
    "spec", ["bf16", "no.such.module.hook", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.no", "torch.nn"]
)
def test_an_unknown_hook_is_refused_naming_it_and_the_names_that_exist(spec):
    names = r"\['bf16_compress', 'fp16_compress'\]"
    with pytest.raises(ValueError, match=rf"`comm_hook='{spec}'` is unknown. Use one of {names}"):
        resolve_comm_hook(spec)


@pytest.mark.parametrize("name", sorted(COMPRESS_HOOK_DTYPES))
def test_the_compressed_hook_rounds_the_bucket_to_its_dtype_and_averages_over_the_group(gloo_world, name):
    dtype = COMPRESS_HOOK_DTYPES[name]
    grad = torch.tensor([1.0 + 2**-12, -3.0, 1e-3, 7.5])
    expected = grad.to(dtype).to(torch.float32)  # one rank: the average is the rounded value itself
    assert not torch.equal(expected, grad)  # the first value is lost in both 16-bit formats
    # DDP's Python reducer (compiled autograd) passes `(grad, param)`; the result is written into the gradient
    result = compressed_allreduce_hook(dtype)(None, (grad, torch.zeros(4))).wait()
    assert result is grad and result.dtype == torch.float32
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
