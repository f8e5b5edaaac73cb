"""Which samples each process trains on: a function of (seed, epoch, micro-step, rank) alone."""
import itertools

import pytest

from lorafuse.train.batches import ShardedBatches, eval_batches


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


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


def test_start_resumes_the_same_stream():
    full = take(ShardedBatches(31, 4, seed=3, rank=1, world_size=2), 11)
    assert take(ShardedBatches(31, 4, seed=3, rank=1, world_size=2, start=5), 6) == full[5:]


def test_two_processes_see_what_one_process_sees_with_accumulation():
    # one process, batch 4, two micro-steps per step == two processes, batch 4, one micro-step each
    one = take(ShardedBatches(40, 4, seed=0, world_size=1), 6)
    two = [take(ShardedBatches(40, 8 // 2, seed=0, rank=rank, world_size=2), 3) for rank in range(2)]
    assert sorted(sum(one, [])) == sorted(sum(two[0] + two[1], []))


def test_fewer_samples_than_a_global_batch_is_an_error():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ShardedBatches(5, 3, seed=0, world_size=2)


@pytest.mark.parametrize("num_samples,world_size,limit", [(10, 1, None), (10, 3, None), (2, 4, None), (50, 2, 3)])
def test_eval_batches_cover_the_split_once_with_equal_counts(num_samples, world_size, limit):
    per_rank = [eval_batches(num_samples, 4, rank, world_size, limit) for rank in range(world_size)]
    counted = sorted(i for mine in per_rank for batch, keep in mine if keep for i in batch)
    expected = list(range(num_samples))[:None if limit is None else limit * 4]
    assert counted == expected
    assert len({len(mine) for mine in per_rank}) == 1
