"""Which samples each process trains on, as a pure function of (seed, epoch, micro-step, rank).

Every epoch is one permutation of the training set drawn from `seed + epoch`; micro-step i of an epoch takes
the i-th slice of `batch_size * world_size` samples, and process `rank` the rank-th part of it. So the data
position is the number of micro-steps done, nothing else: a resumed run starts exactly where the
checkpointed one stopped, and one process with grad_accum=2 sees the same samples as two with grad_accum=1.
"""
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ShardedBatches(Sampler[list[int]]):
    """Index batches of one process, from micro-step `start` on, over as many epochs as needed (endless)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 start: int = 0):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size, self.start = rank, world_size, start
        self.steps_per_epoch = num_samples // (batch_size * world_size)  # the last partial global batch is dropped
        if self.steps_per_epoch == 0:
            raise ValueError(f"{num_samples} training samples are fewer than one global batch "
                             f"(train.batch_size={batch_size} x {world_size} processes)")

    def __iter__(self) -> Iterator[list[int]]:
        step, order, order_epoch = self.start, None, None
        while True:
            epoch, index = divmod(step, self.steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = self._order(epoch), epoch
            first = (index * self.world_size + self.rank) * self.batch_size
            yield order[first:first + self.batch_size].tolist()
            step += 1

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))


def eval_batches(num_samples: int, batch_size: int, rank: int, world_size: int,
                 limit: int | None = None) -> list[tuple[list[int], bool]]:
    """The eval set in order (its first `limit` batches), dealt round-robin to the processes: (indices, counted).

    Every process gets the same number of batches, because under FSDP each forward is a collective; a process
    short of one repeats its last batch with counted=False, and its loss is left out."""
    batches = [list(range(first, min(first + batch_size, num_samples))) for first in range(0, num_samples, batch_size)]
    batches = batches[:limit]
    mine = [(batch, True) for batch in batches[rank::world_size]]
    per_process = -(-len(batches) // world_size)
    while mine and len(mine) < per_process:
        mine.append((mine[-1][0], False))
    if not mine and batches:  # fewer batches than processes
        mine = [(batches[0], False)] * per_process
    return mine
