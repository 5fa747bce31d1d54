"""Mid-epoch data position (`lightning_dpar.checkpoint.resume`) in one process: every data-parallel rank's sampler
is built with its own `rank`, no process group needed.

The rule (see the module docstring): a checkpoint records how many samples of the epoch's global order the ranks
consumed; on resume that prefix is skipped and the rest is dealt out to the new ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lightning_dpar.checkpoint.data_position import DataPosition, ResumableDistributedSampler, make_resumable
from lightning_dpar.checkpoint.resume import align_loop_state

BATCH = 2


def _samplers(n: int, replicas: int, shuffle: bool = True, drop_last: bool = False, epoch: int = 3):
    samplers = []
    for rank in range(replicas):
        plain = DistributedSampler(
            range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
        )
        plain.set_epoch(epoch)
        samplers.append(ResumableDistributedSampler.adopt(plain, BATCH))
    return samplers


def _batches(indices: list[int]) -> list[list[int]]:
    return [indices[i : i + BATCH] for i in range(0, len(indices), BATCH)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_without_a_position_it_is_the_distributed_sampler(shuffle):
    for sampler in _samplers(21, 4, shuffle=shuffle):
        plain = DistributedSampler(range(21), num_replicas=4, rank=sampler.rank, shuffle=shuffle, seed=7)
        plain.set_epoch(3)
        assert list(sampler) == list(plain) and len(sampler) == len(plain)


@pytest.mark.parametrize("shuffle", [True, False])
def test_same_data_parallel_size_continues_each_ranks_own_stream(shuffle):
    n, replicas, done = 40, 4, 3
    before = _samplers(n, replicas, shuffle)
    position = before[0].position(done)
    assert position == DataPosition(epoch=3, batches=done, consumed=done * BATCH * replicas)
    for old, new in zip(before, _samplers(n, replicas, shuffle)):
        new.start_at(position)
        # Exactly the batches the uninterrupted run would read next, and the same epoch length.
        assert _batches(list(new)) == _batches(list(old))[done:]
        assert len(new) == len(old)


@pytest.mark.parametrize(("old_size", "new_size"), [(4, 2), (2, 3), (3, 5), (1, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_another_data_parallel_size_sees_the_rest_of_the_epoch_once(old_size, new_size, drop_last):
    n, done = 60, 2
    before = _samplers(n, old_size, drop_last=drop_last)
    consumed = [i for s in before for i in list(s)[: done * BATCH]]
    position = before[0].position(done)
    assert position.consumed == len(consumed)
    after = _samplers(n, new_size, drop_last=drop_last)
    for sampler in after:
        sampler.start_at(position)
    rest = [i for s in after for i in s]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7 + 3)).tolist()  # the epoch's global order
    assert sorted(consumed) == sorted(order[: len(consumed)])  # the prefix of the global order was consumed
    remaining = order[len(consumed) :]
    if drop_last:  # the tail that does not fill every new rank is dropped, as DistributedSampler does
        remaining = remaining[: len(remaining) - len(remaining) % new_size]
        assert sorted(rest) == sorted(remaining)
    else:  # every remaining sample once, padded with repeats only to fill the last round
        assert set(rest) == set(remaining) and len(rest) - len(remaining) < new_size
    assert not set(rest) & set(consumed)  # nothing trained on before the checkpoint comes again
    for sampler in after:
        # Lightning counts the epoch's batches from its start: the batches done plus this rank's rest.
        assert len(sampler) == done * BATCH + len(list(sampler))


def test_position_counts_on_from_a_resume_point_and_applies_to_its_own_epoch_only():
    (sampler,) = _samplers(30, 1)
    sampler.start_at(DataPosition(epoch=3, batches=4, consumed=12))  # e.g. written by 3 ranks x 2 per batch x 2
    assert sampler.position(6) == DataPosition(epoch=3, batches=6, consumed=12 + 2 * BATCH)
    resumed = list(sampler)
    sampler.set_epoch(4)
    plain = DistributedSampler(range(30), num_replicas=1, rank=0, seed=7)
    plain.set_epoch(4)
    assert list(sampler) == list(plain) != resumed
    assert sampler.position(1) == DataPosition(epoch=4, batches=1, consumed=BATCH)


def test_only_lightnings_plain_loader_is_taken_over():
    data = TensorDataset(torch.arange(10))
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    sampler = make_resumable(loader)
    assert isinstance(sampler, ResumableDistributedSampler) and loader.batch_sampler.sampler is sampler
    assert sampler.batch_size == BATCH and sampler.rank == 1 and sampler.num_replicas == 2
    custom_batches = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), BATCH, drop_last=False))
    assert make_resumable(custom_batches) is None
    assert make_resumable(DataLoader(data, batch_size=BATCH)) is None  # no distributed sampler
    assert make_resumable([1, 2, 3]) is None


def _saved_in_epoch_end_hooks(batches: int, last_batch: bool) -> dict:
    """The loop progress Lightning writes when saving in `on_train_epoch_end` of epoch 0 after `batches` batches."""
    tracker = lambda done, completed: {"ready": done, "started": done, "processed": done, "completed": completed}  # noqa: E731
    return {
        "loops": {
            "fit_loop": {
                "epoch_progress": {"current": tracker(1, 0), "total": tracker(1, 0)},
                "epoch_loop.batch_progress": {
                    "current": tracker(batches, batches),
                    "total": tracker(batches, batches),
                    "is_last_batch": last_batch,
                },
            }
        }
    }


@pytest.mark.parametrize("iteration_based", [False, True])
def test_a_whole_epochs_end_is_not_run_again_under_max_epochs(iteration_based):
    """A save at the end of an epoch trained whole is left for Lightning to start the next epoch under `max_epochs`
    (rewriting it ran the epoch's end hooks twice: an EMA/SWA resume ended off the uninterrupted run); under
    `max_steps` Lightning's loop cannot start the next epoch from it, so it is rewritten and the repeat reported."""
    checkpoint = _saved_in_epoch_end_hooks(4, last_batch=True)
    assert align_loop_state(checkpoint, iteration_based) == (None, iteration_based)
    epoch = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert epoch["processed"] == (0 if iteration_based else 1)


@pytest.mark.parametrize("iteration_based", [False, True])
def test_a_partial_epochs_end_resumes_at_its_next_batch(iteration_based):
    checkpoint = _saved_in_epoch_end_hooks(3, last_batch=False)  # `max_steps` stopped `fit` mid-epoch
    assert align_loop_state(checkpoint, iteration_based) == (None, False)
    epoch = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    assert epoch["current"]["processed"] == epoch["total"]["processed"] == 0
