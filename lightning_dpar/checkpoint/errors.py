"""The errors a checkpoint save raises; each message names the checkpoint, the cause and what to do."""

from __future__ import annotations

__all__ = ["CheckpointSaveError"]


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written on some rank. Raised on every rank; nothing partial is published, and the
    previous checkpoint stays as it was."""
