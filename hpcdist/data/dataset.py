"""Fixed-length windows of a token split, and a distributed order that depends only on seed and epoch.

Sample ``i`` of a split is ``tokens[i*T : i*T + T + 1]`` (inputs and next-token targets) for
context ``T``. An optimizer step consumes one *global batch* of ``world * micro * accum``
consecutive samples of the epoch's permutation; rank ``r`` takes its contiguous share of it,
split into ``accum`` micro-batches. So the samples of a step, and hence its update, are the same
whatever the split between ranks, micro-batches and accumulation, and a run resumed from
``(epoch, position)`` sees exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hpcdist.errors import JobError

if TYPE_CHECKING:
    import torch

IN_MEMORY_BYTES = 512 * 2**20  # splits up to this size are read once into memory


class TokenWindows:
    """The samples of one split of a token file."""

    def __init__(self, path: Path, split: str, context: int) -> None:
        import h5py

        self.path, self.split, self.context = Path(path), split, context
        self._file = h5py.File(self.path, "r")
        dset = self._file[split]
        self._tokens = dset[()] if dset.size * dset.dtype.itemsize <= IN_MEMORY_BYTES else dset
        self.num_tokens = int(dset.shape[0])
        self.num_samples = max(0, (self.num_tokens - 1) // context)

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (len(indices), context) as int64 tensors."""
        import torch

        t = self.context
        rows = np.empty((len(indices), t + 1), dtype=np.int64)
        for j, i in enumerate(indices):
            start = int(i) * t
            rows[j] = self._tokens[start : start + t + 1]
        data = torch.from_numpy(rows)
        return data[:, :-1], data[:, 1:]

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class DistributedOrder:
    """Which samples each rank reads at each step; a pure function of (seed, epoch, position)."""

    num_samples: int
    world_size: int
    rank: int
    micro_batch: int
    accum: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise JobError(
                f"the training split has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch} (world {self.world_size} x micro {self.micro_batch} x accum "
                f"{self.accum}); use more text, a shorter context or a smaller batch"
            )

    def epoch_ends_before(self, position: int) -> bool:
        """Whether no whole global batch is left in the epoch at `position`: the next step starts the
        next epoch. After a resume at another world size `position` need not be a multiple of the
        global batch; for one that is, this is ``steps_per_epoch`` steps per epoch."""
        return position + self.global_batch > self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of all samples: depends only on the seed and the epoch."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def step_samples(self, epoch: int, position: int) -> list[np.ndarray]:
        """This rank's micro-batches for the step starting at `position` samples into `epoch`."""
        order = self.permutation(epoch)
        share = self.micro_batch * self.accum
        start = position + self.rank * share
        mine = order[start : start + share]
        if len(mine) < share:
            raise JobError(
                f"rank {self.rank}: the step at sample {position} of epoch {epoch} runs past the epoch's "
                f"{self.num_samples} samples (global batch {self.global_batch}); this is a bug in resuming"
            )
        return [mine[m * self.micro_batch : (m + 1) * self.micro_batch] for m in range(self.accum)]


def eval_samples(num_samples: int, world_size: int, rank: int, micro_batch: int, batches: int) -> list[np.ndarray]:
    """A fixed set of validation samples (the first ones), dealt to ranks in micro-batches."""
    total = min(num_samples, world_size * micro_batch * batches)
    per_rank = total // world_size
    mine = np.arange(rank * per_rank, (rank + 1) * per_rank)
    return [mine[i : i + micro_batch] for i in range(0, per_rank, micro_batch)]
