"""The errors a checkpoint save or load raises, and how DCP's per-rank failures are described in them; each message
names the checkpoint, the cause and what to do."""

from __future__ import annotations

from torch.distributed.checkpoint import CheckpointException

__all__ = [
    "CheckpointLoadError",
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "describe_dcp_failures",
]


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written on some rank. Raised on every rank; nothing partial is published, and the
    previous checkpoint stays as it was."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the path, the problem and what to do."""


class UnsafeCheckpointError(CheckpointLoadError):
    """A checkpoint file refers to code or types that loading would run or build; nothing from it was run."""


class CorruptCheckpointError(CheckpointLoadError):
    """A checkpoint file is truncated, corrupted or not what its name says."""


def describe_dcp_failures(error: CheckpointException, merge_ranks: bool = True) -> str:
    """Each failing rank's cause, in rank order (DCP's own text is a dict of tracebacks): `rank 0: OSError: ...;
    rank 1: ...`, or with `merge_ranks` the ranks that share one cause listed together (`ranks 0, 1: ...`). A cause
    that is a `CheckpointLoadError` already names its file and is given by its message alone."""
    causes: list[tuple[str, list[int]]] = []
    for rank, (cause, _trace) in sorted(error.failures.items()):
        text = str(cause) if isinstance(cause, CheckpointLoadError) else f"{type(cause).__name__}: {cause}"
        same = [ranks for known, ranks in causes if known == text] if merge_ranks else []
        if same:
            same[0].append(rank)
        else:
            causes.append((text, [rank]))
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}" for text, ranks in causes
    )
