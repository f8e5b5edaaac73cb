"""Which samples each process trains on, as a pure function of (seed, optimizer step, micro-step, rank).

An optimizer step consumes one global batch of `batch_size * world_size * grad_accum` samples; an epoch is as
many whole global batches as the training set holds, one permutation of it drawn from `seed + epoch`. Micro-step
`a` of a step takes, on process `r`, the part `a * world_size + r` of the step's global batch. So the samples of
every optimizer step depend only on the global batch size: one process with grad_accum=2 trains on the same
samples per step as two processes with grad_accum=1, in every epoch, and a resumed run (whatever its layout)
continues from the step it was checkpointed at.
"""
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ShardedBatches(Sampler[list[int]]):
    """This process's index batches, one per micro-step, from optimizer step `start_step` on (endless)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 grad_accum: int = 1, start_step: int = 0):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size, self.grad_accum, self.start_step = rank, world_size, grad_accum, start_step
        self.global_batch = batch_size * world_size * grad_accum
        self.steps_per_epoch = num_samples // self.global_batch  # the last partial global batch is dropped
        if self.steps_per_epoch == 0:
            raise ValueError(f"{num_samples} training samples are fewer than one global batch of "
                             f"{self.global_batch} (batch size {batch_size} x {world_size} processes x "
                             f"{grad_accum} accumulation steps)")

    def __iter__(self) -> Iterator[list[int]]:
        step, order, order_epoch = self.start_step, None, None
        while True:
            epoch, index = divmod(step, self.steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = self._order(epoch), epoch
            for micro in range(self.grad_accum):
                first = index * self.global_batch + (micro * self.world_size + self.rank) * self.batch_size
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
