"""Checkpointing: sharded (DCP) and full formats, atomic and async writing, exact resume, safe loading.

Modules, by concern:

- `manager`: the one owner of save, load, async writes, removal and resume state; the strategy calls only it.
- `storage`: local paths and fsspec URLs (`Location`).
- `contents`: what a checkpoint directory contains, how to tell a complete one, what is wrong with a damaged one,
  and the scan of a directory's checkpoints.
- `errors`: the save and load errors, and how DCP's per-rank failures read in them.
- `safe_io`: loading without running pickled code.
- `sharded`: model and optimizer shards (DCP); `full`: the single-file format.
- `writer`: foreground and background saves; `atomic`: the steps that make a save atomic (partial directory,
  publishing, links); `staging`: the reused CPU buffers of async saves; `agreement`: one rank's problem told to all.
- `resume`: per-rank RNG streams and loop progress; `data_position`: where the data stands within an epoch.
- `model_shaped`: callback state shaped like the model (averaged weights); `mapped`: giving back the pages of a
  memory-mapped full-format file once copied out.
- `discovery`: which checkpoint `ckpt_path="last"` means after a crash.
- `inference`: `load_from_checkpoint` on one process; `offline_reader`: reading a sharded checkpoint offline (for
  `consolidate`); `hf_export`: writing a Hugging Face model directory.
"""

from lightning_dpar.checkpoint.errors import CheckpointLoadError

__all__ = ["CheckpointLoadError"]
