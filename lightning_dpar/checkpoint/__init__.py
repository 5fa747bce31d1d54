"""Checkpointing: sharded (DCP) and full formats, atomic and async writing, exact resume, safe loading.

Modules, by concern: `storage` (local paths and fsspec URLs), `layout` (what a checkpoint contains, validation),
`safe_io` (loading without running pickled code), `sharded` (model/optimizer shards), `writer` (atomic and async
saves), `resume` (per-rank RNG and data position), `full` (the single-file format), `inference`
(`load_from_checkpoint` on one process), `export` (reading a sharded checkpoint offline, for `consolidate`).
"""

from lightning_dpar.checkpoint.errors import CheckpointLoadError

__all__ = ["CheckpointLoadError"]
