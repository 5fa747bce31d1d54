"""The example data (`lightning_dpar.examples.stdlib_data`): a directory's `.py` sources as bytes in sorted path
order, cut into windows of `block_size + 1`, the validation split the tail; read here from a directory the test
writes, so every byte is known."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.examples.stdlib_data import ByteWindows, StdlibBytes, stdlib_source_bytes


@pytest.fixture
def sources(tmp_path):
    (tmp_path / "b.py").write_bytes(b"B" * 30)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.py").write_bytes(b"A" * 20)
    (tmp_path / "notes.txt").write_bytes(b"not python")
    for skipped in ("site-packages", "__pycache__"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "c.py").write_bytes(b"C" * 10)
    return tmp_path


def test_the_sources_in_sorted_path_order_without_third_party_or_caches(sources):
    assert stdlib_source_bytes(1000, str(sources)) == b"A" * 20 + b"B" * 30
    assert stdlib_source_bytes(25, str(sources)) == b"A" * 20 + b"B" * 5
    with pytest.raises(FileNotFoundError, match="No Python sources found under"):
        stdlib_source_bytes(100, str(sources / "a" / "empty"))


def test_windows_are_non_overlapping_token_ids_dropping_the_remainder():
    windows = ByteWindows(bytes(range(10)), 3)
    assert len(windows) == 3
    assert windows[2].tolist() == [6, 7, 8] and windows[2].dtype == torch.int64
    with pytest.raises(ValueError, match="2 bytes are fewer than one window of 3"):
        ByteWindows(b"ab", 3)


def test_the_validation_split_is_the_tail_and_the_batches_have_the_shape_announced(sources):
    data = StdlibBytes(block_size=4, batch_size=2, val_fraction=0.2, root=str(sources))
    data.setup("fit")
    assert data.batch_shape == (2, 5)
    assert len(data.train_set) == 40 // 5 and len(data.val_set) == 10 // 5  # 50 bytes: 40 train, 10 validation
    assert bytes(data.val_set.windows.flatten().tolist()) == b"B" * 10
    batch = next(iter(data.val_dataloader()))
    assert batch.shape == data.batch_shape
    assert sum(len(b) for b in data.train_dataloader()) == 8  # drop_last: 4 full batches of 2
    with pytest.raises(ValueError, match=r"`val_fraction=1.0` must be between 0 and 1"):
        StdlibBytes(val_fraction=1.0)
