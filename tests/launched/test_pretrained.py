"""Pretrained Hugging Face weights through real Trainers on 2 and 4 gloo ranks (workers in
`tests/workers/pretrained.py`): loading into shards under `dpar_fsdp`, `dpar_replicate` and `dpar_2d`, fine-tuning
parity, strictness, export back with `consolidate --format hf`, and the memory a rank needs to load. Key matching and
the other in-process tests (and the tiny models and weights directory used here) are in
`tests/unit/hf_weights/test_pretrained.py`."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_dpar.hf_weights.pretrained import checkpoint_shapes
from tests.conftest import ROOT, run_script, run_workers
from tests.support.hf_configs import decoder_settings

transformers = pytest.importorskip("transformers")

from tests.unit.hf_weights import test_pretrained as unit_half  # noqa: E402
from tests.unit.hf_weights.test_pretrained import save_llama  # noqa: E402

shared_dir = unit_half.shared_dir  # the fixture: the tiny models' weights on disk

#: 6 layers of hidden 1024 and an 8192 vocabulary: 336 MB of fp32 weights, the largest tensor 32 MiB.
BIG = decoder_settings(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
#: What loading may add to a rank's RSS beyond the bound's two terms: DCP's plans and the safetensors handles'
#: bookkeeping, Python objects, allocator slack.
MEMORY_ALLOWANCE = 64 * 2**20


@pytest.fixture(scope="module")
def results2(shared_dir):
    return run_workers(2, "pretrained_parity,pretrained_errors,pretrained_meta,pretrained_export", shared_dir)


@pytest.fixture(scope="module")
def results4(shared_dir):
    save_llama(shared_dir / "big_llama", BIG, "100MB")
    return run_workers(4, "pretrained_parity,pretrained_memory", shared_dir)


# ---------------------------------------------------------------------- through real Trainers
LOAD_CASES = [("fsdp", 2), ("replicate", 2), ("pp", 2), ("fsdp", 4), ("replicate", 4), ("2d", 4), ("pp", 4)]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "world"), LOAD_CASES)
def test_pretrained_weights_load_exactly_and_fine_tune_like_one_process(request, strategy, world):
    """After setup the full parameters are bit-for-bit `from_pretrained`'s (the model started from other random
    values); three AdamW steps then match single-process training from `from_pretrained` on the same batches."""
    result = request.getfixturevalue(f"results{world}")[f"pretrained_{strategy}_{world}"]
    assert result["random_init_diff"] > 0.1
    assert result["loaded_max_abs_diff"] == 0.0
    assert result["trained_max_abs_diff"] < 1e-5


@pytest.mark.slow
def test_tied_model_under_transformers_plan_loads_exactly_stays_tied_and_exports_the_key_once(results4):
    """tie_word_embeddings with tp_plan="auto" (the embedding and head share one DTensor): the load is bit-for-bit
    `from_pretrained`'s, fine-tuning matches one process, the tie holds after training, and `--format hf` writes
    the tied key once; `from_pretrained` of the export ties again and holds the trained values."""
    result = results4["pretrained_2d_auto_4"]
    assert result["random_init_diff"] > 0.1
    assert result["loaded_max_abs_diff"] == 0.0
    assert result["trained_max_abs_diff"] < 1e-5
    assert result["still_tied"]
    assert result["export_code"] == 0
    assert "model.embed_tokens.weight" in result["exported_keys"] and "lm_head.weight" not in result["exported_keys"]
    assert result["export_reties"]
    assert result["export_max_abs_diff"] == 0.0


@pytest.mark.slow
def test_key_mismatch_is_named_on_every_rank_and_lenient_load_keeps_the_rest(results2):
    result = results2["pretrained_errors"]
    for messages in result["strict_messages"]:
        assert len(messages) == 1 and "keys of the model not in the checkpoint: 'extra_head.weight'" in messages[0]
    assert result["lenient_loaded_diff"] == 0.0
    assert result["lenient_extra_kept"] == 0.0


@pytest.mark.slow
def test_pretrained_weights_overwrite_a_model_materialised_from_the_meta_device(results2):
    result = results2["pretrained_meta"]
    assert result["built_on_meta"]
    assert result["loaded_max_abs_diff"] == 0.0
    assert result["head_finite_nonzero"]  # not in the checkpoint: initialised by reset_parameters, never garbage


@pytest.mark.slow
def test_hf_export_of_a_checkpoint_without_a_transformers_model_is_an_error(results2):
    result = results2["pretrained_meta"]
    assert result["hf_export_code"] == 1 and not result["hf_export_wrote"]
    assert "has no Hugging Face config" in result["hf_export_error"]
    assert "--strip-prefix" in result["hf_export_error"]


@pytest.mark.slow
def test_consolidate_format_hf_loads_with_from_pretrained_exactly(results2):
    result = results2["pretrained_export"]
    assert result["codes"] == [0, 0]
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(result["files"])
    assert result["missing"] == [] and result["unexpected"] == []
    assert result["max_abs_diff"] == 0.0
    # The plain format keeps every tensor, tied copy included, with only the given prefix removed.
    assert result["strip_prefix_keys"] == result["model_keys"]


@pytest.mark.slow
def test_loading_memory_is_at_most_the_rank_share_plus_the_largest_tensor(results4, shared_dir):
    shapes = checkpoint_shapes(shared_dir / "big_llama")
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    largest = max(torch.Size(s).numel() * 4 for s in shapes.values())
    assert total >= 256 * 2**20
    for report in results4["pretrained_memory"]:
        assert report["rank_share_bytes"] <= total // 4 + largest  # FSDP on 4 ranks
        assert report["increase_bytes"] <= report["rank_share_bytes"] + largest + MEMORY_ALLOWANCE, report


@pytest.mark.slow
def test_finetune_example_runs_end_to_end(tmp_path):
    """examples/finetune/run.py: writes a tiny Llama with save_pretrained, fine-tunes it with dpar_2d on 4 processes
    from those weights, exports with --format hf and reloads the export with from_pretrained."""
    proc = run_script([str(ROOT / "examples" / "finetune" / "run.py"), "--max-steps", "6"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "from_pretrained('finetuned'): missing keys [], unexpected keys []" in proc.stdout
    loaded = re.findall(
        r"Loaded pretrained weights .*: \d+ tensors in [\d.]+ s; this rank read", proc.stdout + proc.stderr
    )
    assert len(loaded) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # one line, from rank 0
    before, after = map(float, re.search(r"pretrained ([\d.]+) -> fine-tuned ([\d.]+)", proc.stdout).groups())
    assert after < before - 0.1  # the export holds the fine-tuned weights, not the pretrained (or random) ones
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in (tmp_path / "finetuned").iterdir()
    }
