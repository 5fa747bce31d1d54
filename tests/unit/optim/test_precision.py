"""`DparPrecision`: which outputs it converts. Under autocast (bf16-mixed on a DDP-style replicate) a forward's
floating outputs come back in the default dtype, so a loss computed outside the forward (a Fabric loop) is fp32;
elsewhere outputs are left as they are."""

from __future__ import annotations

import torch

from lightning_dpar.optim.precision import DparPrecision


def test_autocast_outputs_come_back_in_the_default_dtype_and_others_untouched():
    plugin = DparPrecision("bf16-mixed")
    output = {"logits": torch.ones(2, dtype=torch.bfloat16), "ids": torch.ones(2, dtype=torch.int64)}
    assert plugin.convert_output(output)["logits"].dtype == torch.bfloat16  # FSDP2's root unit returns fp32 itself
    plugin.autocast_on("cpu")
    converted = plugin.convert_output(output)
    assert converted["logits"].dtype == torch.float32 and converted["ids"].dtype == torch.int64
    true_bf16 = DparPrecision("bf16-true")
    true_bf16.autocast_on("cpu")
    assert true_bf16.convert_output(output)["logits"].dtype == torch.bfloat16  # bf16-true: bf16 throughout
