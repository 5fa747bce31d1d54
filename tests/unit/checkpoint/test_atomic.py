"""The pure rules of atomic checkpoint saving, in-process (no process group): hidden temporary names and which
leftovers a save sweeps, publishing over an existing checkpoint, deferred removal while a save is in flight, and
how a failed save is reported."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_dpar.checkpoint import atomic, contents, staging, writer
from lightning_dpar.checkpoint.errors import CheckpointSaveError
from lightning_dpar.checkpoint.storage import Location


def test_partial_names_are_hidden_and_never_look_like_a_checkpoint():
    name = contents.partial_name("last.ckpt", "abcd1234")
    assert name.startswith(".") and not name.endswith(".ckpt") and "last" not in name
    assert contents.partial_name("last.ckpt", "x") != contents.partial_name("step=1.ckpt", "x")


def test_leftovers_are_matched_by_final_name_only():
    names = [
        contents.partial_name("step=1.ckpt", "aaaa"),
        contents.partial_name("step=10.ckpt", "bbbb"),  # another checkpoint's save in flight: never swept
        contents.REPLACED_PREFIX + contents.partial_name("step=1.ckpt", "cccc")[len(contents.PARTIAL_PREFIX) :],
        "step=1.ckpt",
    ]
    assert contents.partial_names_for("step=1.ckpt", names) == [names[0], names[2]]


def _complete(path: Path, content: str) -> Location:
    path.mkdir()
    (path / "meta.pt").write_text(content)
    return Location.parse(path)


def test_publish_replaces_an_existing_checkpoint_and_leaves_no_hidden_directory(tmp_path):
    final = _complete(tmp_path / "last.ckpt", "old")
    partial = _complete(tmp_path / contents.partial_name("last.ckpt", "abcd"), "new")
    atomic.publish(partial, final)
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert (tmp_path / "last.ckpt" / "meta.pt").read_text() == "new"


def test_publish_replaces_a_dangling_link(tmp_path):
    os.symlink("step=9.ckpt", tmp_path / "last.ckpt")
    partial = _complete(tmp_path / contents.partial_name("last.ckpt", "abcd"), "new")
    atomic.publish(partial, Location.parse(tmp_path / "last.ckpt"))
    assert not os.path.islink(tmp_path / "last.ckpt") and os.listdir(tmp_path) == ["last.ckpt"]


def test_remove_leftovers_sweeps_only_this_names_interrupted_saves(tmp_path):
    mine = tmp_path / contents.partial_name("step=1.ckpt", "aaaa")
    other = tmp_path / contents.partial_name("step=2.ckpt", "bbbb")
    mine.mkdir(), other.mkdir()
    atomic.remove_leftovers(Location.parse(tmp_path / "step=1.ckpt"))
    assert sorted(os.listdir(tmp_path)) == [other.name]


def _writer_with_save_in_flight(tmp_path: Path) -> tuple[writer.CheckpointWriter, writer._InFlight]:
    checkpoint_writer = writer.CheckpointWriter(async_save=True)
    in_flight = writer._InFlight(Location.parse(tmp_path / "step=2.ckpt"))
    checkpoint_writer._in_flight = in_flight
    return checkpoint_writer, in_flight


def test_removal_waits_until_the_save_in_flight_is_published(tmp_path):
    superseded = _complete(tmp_path / "step=1.ckpt", "old")
    checkpoint_writer, in_flight = _writer_with_save_in_flight(tmp_path)
    checkpoint_writer.remove(superseded, is_global_zero=True)
    assert superseded.exists()  # a kill now still leaves step=1 on disk
    checkpoint_writer._after_publish(in_flight)
    assert not superseded.exists()


def test_removal_after_publish_is_immediate(tmp_path):
    superseded = _complete(tmp_path / "step=1.ckpt", "old")
    checkpoint_writer, in_flight = _writer_with_save_in_flight(tmp_path)
    checkpoint_writer._after_publish(in_flight)
    checkpoint_writer.remove(superseded, is_global_zero=True)
    assert not superseded.exists()


def test_removals_of_a_failed_save_are_dropped(tmp_path):
    superseded = _complete(tmp_path / "step=1.ckpt", "old")
    checkpoint_writer, in_flight = _writer_with_save_in_flight(tmp_path)
    checkpoint_writer.remove(superseded, is_global_zero=True)
    in_flight.done.set_exception(CheckpointSaveError("disk full"))
    with pytest.raises(CheckpointSaveError):
        checkpoint_writer.wait()
    assert superseded.exists()


def test_only_rank_zero_deletes(tmp_path):
    superseded = _complete(tmp_path / "step=1.ckpt", "old")
    writer.CheckpointWriter().remove(superseded, is_global_zero=False)
    assert superseded.exists()


def test_close_gives_up_on_a_save_that_never_finishes(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(writer, "CLOSE_MARGIN_S", 0.2)
    checkpoint_writer, _ = _writer_with_save_in_flight(tmp_path)
    checkpoint_writer.timeout = timedelta(seconds=0.1)
    checkpoint_writer.close()  # the in-flight future never completes
    assert "abandoned" in caplog.text and "step=2.ckpt" in caplog.text


def test_dcp_failures_become_one_error_naming_checkpoint_and_each_rank(tmp_path):
    final = Location.parse(tmp_path / "step=3.ckpt")
    partial = _complete(tmp_path / contents.partial_name("step=3.ckpt", "abcd"), "partial")
    failures = {0: (OSError(28, "No space left on device"), None), 1: (OSError(28, "No space left on device"), None)}
    with pytest.raises(CheckpointSaveError) as raised:
        with atomic.reported_as_save_error(final, partial, timeout=None):
            raise CheckpointException("save failed", failures)
    message = str(raised.value)
    assert "step=3.ckpt" in message and "rank 0: OSError" in message and "rank 1: OSError" in message
    assert "No space left on device" in message and "previous checkpoint is untouched" in message
    assert not partial.exists()  # what was written is removed


def test_a_timeout_is_reported_as_an_unresponsive_rank(tmp_path):
    final = Location.parse(tmp_path / "step=3.ckpt")
    partial = Location.parse(tmp_path / contents.partial_name("step=3.ckpt", "abcd"))
    timeout = timedelta(seconds=20)
    with pytest.raises(CheckpointSaveError, match=r"stopped responding during the checkpoint write.*20 s"):
        with atomic.reported_as_save_error(final, partial, timeout):
            raise RuntimeError("[gloo] Timed out waiting 20000ms for recv operation to complete")


def test_staging_buffers_are_kept_across_saves_and_released_on_close():
    checkpoint_writer = writer.CheckpointWriter(async_save=True)
    stager = checkpoint_writer._staging_buffers()
    assert checkpoint_writer._staging_buffers() is stager
    checkpoint_writer.close()
    assert checkpoint_writer._stager is None


def test_staging_copies_every_tensor_into_buffers_reused_across_saves():
    weight, step = torch.arange(6.0).reshape(2, 3), torch.tensor(3.0)
    state = {
        "model": {"w": weight, "w_t": weight.t()},
        "opt": {"state": {"w": {"step": step}}, "groups": [{"lr": 0.1}]},
    }
    stager = staging.ReusedBufferStager()
    first = stager.stage(state)
    assert torch.equal(first["model"]["w"], weight) and first["model"]["w"].data_ptr() != weight.data_ptr()
    assert torch.equal(first["model"]["w_t"], weight.t()) and first["opt"]["groups"] == [{"lr": 0.1}]
    weight.add_(1)  # training goes on: the staged copy must not change ...
    assert torch.equal(first["model"]["w"], torch.arange(6.0).reshape(2, 3))
    second = stager.stage(state)  # ... and the next save copies the new values into the same memory
    assert (
        torch.equal(second["model"]["w"], weight) and second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    )
    state["model"]["w"] = torch.zeros(3, 3)  # another shape at that position: a new buffer
    assert stager.stage(state)["model"]["w"].shape == (3, 3)


def test_staging_keeps_dtensor_layout(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    local = torch.arange(4.0).reshape(2, 2)
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    staged = staging.ReusedBufferStager().stage({"w": dtensor})["w"]
    assert isinstance(staged, DTensor) and staged.placements == (Shard(0),) and staged.shape == (4, 2)
    assert torch.equal(staged.to_local(), local) and staged.to_local().data_ptr() != local.data_ptr()


def test_staged_dtensors_are_kept_across_saves_while_their_layout_holds(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    local = torch.arange(4.0).reshape(2, 2)
    stager = staging.ReusedBufferStager()
    first = stager.stage({"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)})["w"]
    local.add_(1)  # the next save: new values, the same layout
    second = stager.stage({"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)})["w"]
    assert second is first and torch.equal(second.to_local(), local)
    replicated = stager.stage({"w": DTensor.from_local(local, mesh, [Replicate()], run_check=False)})["w"]
    assert replicated is not first and replicated.placements == (Replicate(),) and replicated.shape == (2, 2)


def test_per_rank_values_join_the_record_as_lists_in_rank_order():
    record = {"world_size": 2, "strategy": "FullyShardStrategy"}
    merged = atomic.with_per_rank(record, [{"rng_states": "rank 0's"}, {"rng_states": "rank 1's"}])
    assert merged == {**record, "rng_states": ["rank 0's", "rank 1's"]}
    assert atomic.with_per_rank(record, [{}, {}]) == record


def test_async_save_that_cannot_stage_names_the_checkpoint_and_writes_nothing(tmp_path):
    checkpoint_writer = writer.CheckpointWriter(async_save=True)
    unreadable = {"model": {"w": torch.empty(2, device="meta")}}  # a meta tensor has no data to copy
    with pytest.raises(CheckpointSaveError, match=r"step=1\.ckpt.*could not copy its shards to CPU memory"):
        checkpoint_writer.save(unreadable, {}, str(tmp_path / "step=1.ckpt"))
    assert os.listdir(tmp_path) == []
    checkpoint_writer.close()


def test_close_ends_the_writers_thread_and_process_group(tmp_path):
    """What an async save starts (its thread and its gloo group) ends at teardown: alive at interpreter shutdown,
    either could abort a process that trained successfully. The next async save starts them again."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        checkpoint_writer = writer.CheckpointWriter(async_save=True)
        for step in (1, 2):
            checkpoint_writer.save({"w": torch.ones(3) * step}, {}, str(tmp_path / f"step={step}.ckpt"))
            group, thread = checkpoint_writer._group, checkpoint_writer._thread
            assert group is not None and thread is not None and thread.is_alive()
            checkpoint_writer.close()
            assert (tmp_path / f"step={step}.ckpt" / contents.METADATA_FILENAME).exists()
            assert not thread.is_alive() and checkpoint_writer._group is None
            with pytest.raises(ValueError, match="not registered"):
                dist.get_rank(group)  # destroyed
    finally:
        dist.destroy_process_group()
