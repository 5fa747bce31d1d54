"""Which checkpoint `ckpt_path="last"` means after a crash: the newest complete checkpoint, never a fresh start.

Lightning resolves `"last"` to the newest `last*.ckpt` that exists, and starts from scratch (with a warning) when
there is none. After a kill during a save that is wrong in two ways: with `save_last="link"` the link can point at a
checkpoint that was never completed (so it "does not exist" and training silently restarts from step 0), and the
newest complete checkpoint may carry another name. Here the checkpoint directories of the `ModelCheckpoint`
callbacks are searched for complete checkpoints: the newest wins, and a directory with only interrupted saves is an
error rather than a fresh start. Damage of any kind (an interrupted save, a missing or truncated data file, an
unreadable index, `meta.pt` or full-format file) makes a checkpoint skipped the same way, and the log line that
names the checkpoint picked names each one skipped and why.
"""

from __future__ import annotations

from lightning_dpar.checkpoint.contents import DirectoryScan
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.storage import Location

__all__ = ["resolve_last"]

CHECKPOINT_SUFFIX = ".ckpt"
#: How Lightning's `ModelCheckpoint` names its "last" checkpoints (`last.ckpt`, `last-v1.ckpt`).
LAST_PREFIX = "last"


def resolve_last(directories: list[Location]) -> tuple[str | None, str]:
    """The newest complete checkpoint in `directories` and a sentence saying why it was picked.

    Returns `(None, reason)` when the directories hold no checkpoint at all (a first run: Lightning's own
    `ckpt_path="last"` handling applies). Raises `CheckpointLoadError` when they hold only interrupted saves.
    """
    complete: dict[str, float] = {}
    incomplete: dict[str, str] = {}
    for directory in directories:
        scan = DirectoryScan.of(directory, accept=lambda entry: entry.name.endswith(CHECKPOINT_SUFFIX))
        complete.update((entry.url, written) for entry, written in scan.complete.items())
        incomplete.update((entry.url, why) for entry, why in scan.incomplete.items())
    where = ", ".join(repr(d.url) for d in directories)
    if complete:
        # Ties (a `save_last="link"` link and its target) go to the `last*` name, as Lightning's own "last" would.
        newest = max(complete, key=lambda url: (complete[url], url.rsplit("/", 1)[-1].startswith(LAST_PREFIX)))
        skipped = "".join(f"; skipped {url!r}: {why}" for url, why in sorted(incomplete.items()))
        return newest, f"the newest complete checkpoint in {where}{skipped}"
    if incomplete:
        raise CheckpointLoadError(
            f"`ckpt_path='last'`: {where} holds no complete checkpoint, only interrupted or damaged"
            f" ones: {'; '.join(f'{url!r}: {why}' for url, why in sorted(incomplete.items()))}."
            " Training is not restarted from scratch silently. Pass `ckpt_path` of a checkpoint kept elsewhere, or"
            " remove these entries (or pass `ckpt_path=None`) to start from scratch."
        )
    return None, f"no checkpoint in {where}"
