"""A corrupt checkpoint (`lightning_dpar/checkpoint/safe_io.py`'s errors) names the damaged file and what to do:
copy it again, or resume from the newest other complete checkpoint (`checkpoint/layout.py`). Hostile checkpoints are
`tests/launched/test_checkpoint_safety.py`."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

import lightning_dpar
from lightning_dpar.checkpoint.contents import newest_other_checkpoint
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.storage import Location
from tests.support.checkpoint_files import Tiny, copy_of, write_full, write_sharded


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_sharded(tmp_path_factory.mktemp("pristine") / "good.ckpt")


@pytest.fixture
def directory_with_history(pristine, tmp_path) -> tuple[Path, Path]:
    """`older.ckpt` (complete), then `victim.ckpt` (the one to damage), plus a hidden partial directory."""
    older = copy_of(pristine, tmp_path, "older.ckpt")
    victim = copy_of(pristine, tmp_path, "victim.ckpt")
    os.utime(older / "meta.pt", (1, 1))  # when a checkpoint was completed: its meta.pt, written last
    (tmp_path / "run" / ".dpar-partial-abc").mkdir()
    return older, victim


def _load_error(checkpoint: Path) -> str:
    with pytest.raises(CheckpointLoadError) as caught:
        lightning_dpar.load_from_checkpoint(Tiny, checkpoint)
    return str(caught.value)


def test_truncated_meta_pt_names_it_and_the_previous_checkpoint(directory_with_history):
    older, victim = directory_with_history
    data = (victim / "meta.pt").read_bytes()
    (victim / "meta.pt").write_bytes(data[: len(data) // 2])
    message = _load_error(victim)
    assert message.startswith(f"{str(victim / 'meta.pt')!r} cannot be read (")
    assert "the file is truncated or corrupted. If it was copied here, copy it again" in message
    assert f"resume from the previous checkpoint: {str(older)!r} is the newest other complete one" in message
    assert "negative seek value" not in message


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupted"])
def test_damaged_shard_says_to_copy_it_again_or_resume_from_the_previous_one(directory_with_history, damage):
    older, victim = directory_with_history
    shard = victim / "__0_0.distcp"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    message = _load_error(victim)
    assert message.startswith(f"{str(shard)!r} is {damage}")
    assert "Copy '__0_0.distcp' again from the machine that wrote it" in message
    assert f"{str(older)!r} is the newest other complete one" in message


def test_no_previous_checkpoint_is_said_so(pristine, tmp_path):
    victim = copy_of(pristine, tmp_path)
    (victim / "__0_0.distcp").unlink()
    assert "there is no other complete one in" in _load_error(victim)


def test_newest_other_checkpoint_skips_hidden_links_and_incomplete(directory_with_history, tmp_path):
    older, victim = directory_with_history
    (tmp_path / "run" / "last.ckpt").symlink_to(victim)
    incomplete = tmp_path / "run" / "incomplete.ckpt"
    incomplete.mkdir()
    (incomplete / ".metadata").write_bytes(b"")
    assert newest_other_checkpoint(Location.parse(victim)) == Location.parse(older)
    newer = copy_of(older, tmp_path, "newer.ckpt")
    os.utime(newer / "meta.pt", (2, 2))
    assert newest_other_checkpoint(Location.parse(victim)) == Location.parse(newer)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "not written by `torch.save` (or is truncated to 0 bytes)"),
        (pickle.dumps({"state_dict": {}}), "a plain pickle, which is never loaded"),
    ],
)
def test_full_format_file_that_is_no_torch_save_is_named(tmp_path, content, expected):
    file = tmp_path / "model.ckpt"
    file.write_bytes(content)
    message = _load_error(file)
    assert message.startswith(f"{str(file)!r} is not a checkpoint: it is ") and expected in message


def test_truncated_full_format_file_names_it(tmp_path):
    file = write_full(tmp_path / "model.ckpt")
    write_full(tmp_path / "earlier.ckpt")
    os.utime(tmp_path / "earlier.ckpt", (1, 1))
    file.write_bytes(file.read_bytes()[:-200])
    message = _load_error(file)
    assert message.startswith(f"{str(file)!r} cannot be read (") and "truncated or corrupted" in message
    assert f"{str(tmp_path / 'earlier.ckpt')!r} is the newest other complete one" in message
