"""`lightning_dpar.loss_parallel.estimate`: a rank's share of the logits, the log-softmax backward a trace runs as
torch's vocabulary-parallel cross-entropy does, and the report's line. The traced step under loss parallel:
`tests/unit/estimates/test_activations.py`."""

from __future__ import annotations

import torch

from lightning_dpar._private_api import log_softmax_backward_op
from lightning_dpar.loss_parallel.estimate import describe_sharded_logits, logit_bytes, vocabulary_parallel_gradient


def test_loss_parallel_keeps_a_vocabulary_shard_of_the_logits_rounded_up():
    assert logit_bytes(1000, 4, loss_parallel=False) == 1000
    assert logit_bytes(1000, 4, loss_parallel=True) == 250
    assert logit_bytes(1001, 4, loss_parallel=True) == 251


def test_the_log_softmax_backward_of_split_logits_hands_the_gradient_through():
    grad = torch.ones(2, 3)
    log_probs = torch.zeros(2, 3)
    op = log_softmax_backward_op()
    args = (grad, log_probs, 1, torch.bfloat16)
    passed = vocabulary_parallel_gradient(op, args, is_split=lambda t: t is grad)
    assert passed is not None and passed.dtype == torch.bfloat16 and torch.equal(passed.float(), grad)
    assert vocabulary_parallel_gradient(op, args, is_split=lambda t: False) is None  # whole logits: the op runs
    assert vocabulary_parallel_gradient(torch.ops.aten.mm.default, (grad, grad.T), is_split=lambda t: True) is None


def test_the_report_line_names_the_output_layer():
    assert describe_sharded_logits("model.head") == (
        "  loss parallel: the logits of model.head kept sharded over the vocabulary"
    )
