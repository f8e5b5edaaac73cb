"""Which samples each process trains on: a function of (seed, optimizer step, micro-step, rank) alone."""
import itertools

import pytest

from lorafuse.train.batches import ShardedBatches, eval_batches


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def per_step(batches, micro_steps):
    """Micro-batches grouped into optimizer steps, as sets of sample indices."""
    return [set(sum(batches[i:i + micro_steps], [])) for i in range(0, len(batches), micro_steps)]


def test_an_epoch_visits_every_sample_once_across_processes():
    # 23 samples, 2 processes x batch 3: 3 global batches of 6 per epoch, 5 samples dropped
    shards = [take(ShardedBatches(23, 3, seed=1, rank=rank, world_size=2), 3) for rank in range(2)]
    seen = [i for shard in shards for batch in shard for i in batch]
    assert all(len(batch) == 3 for shard in shards for batch in shard)
    assert len(seen) == len(set(seen)) == 18


def test_epochs_are_reshuffled_and_reproducible():
    sampler = ShardedBatches(10, 5, seed=7)
    first, second = take(sampler, 4), take(ShardedBatches(10, 5, seed=7), 4)
    assert first == second
    assert sorted(first[0] + first[1]) == list(range(10)) == sorted(first[2] + first[3])
    assert first[:2] != first[2:]


def test_start_step_resumes_the_same_stream():
    full = take(ShardedBatches(31, 4, seed=3, rank=1, world_size=2, grad_accum=2), 22)
    assert take(ShardedBatches(31, 4, seed=3, rank=1, world_size=2, grad_accum=2, start_step=5), 12) == full[10:]


@pytest.mark.parametrize("num_samples", [40, 44, 47])
def test_steps_see_the_same_samples_whatever_the_layout(num_samples):
    # one process x 2 accumulation steps == two processes x 1 == four processes x 1 at batch 2, step by step,
    # across epoch boundaries (44 and 47 samples do not divide into whole epochs the same way per process)
    steps = 12
    one = per_step(take(ShardedBatches(num_samples, 4, seed=5, grad_accum=2), 2 * steps), 2)
    two = [take(ShardedBatches(num_samples, 4, seed=5, rank=r, world_size=2), steps) for r in range(2)]
    four = [take(ShardedBatches(num_samples, 2, seed=5, rank=r, world_size=4), steps) for r in range(4)]
    assert one == [set(a + b) for a, b in zip(*two)] == [set(sum(batches, [])) for batches in zip(*four)]


def test_fewer_samples_than_a_global_batch_is_an_error():
    with pytest.raises(ValueError, match="fewer than one global batch of 12"):
        ShardedBatches(11, 3, seed=0, world_size=2, grad_accum=2)


@pytest.mark.parametrize("num_samples,world_size,limit", [(10, 1, None), (10, 3, None), (2, 4, None), (50, 2, 3)])
def test_eval_batches_cover_the_split_once_with_equal_counts(num_samples, world_size, limit):
    per_rank = [eval_batches(num_samples, 4, rank, world_size, limit) for rank in range(world_size)]
    counted = sorted(i for mine in per_rank for batch, keep in mine if keep for i in batch)
    expected = list(range(num_samples))[:None if limit is None else limit * 4]
    assert counted == expected
    assert len({len(mine) for mine in per_rank}) == 1
