"""ElasticSampler: a DistributedSampler that resumes mid-epoch at any world size (data plane).

The epoch's order is one shuffle of the whole dataset, the same on every rank (seeded by
``seed + epoch``). Ranks take strided shares of what is left of it; since they step batches in
lock step, the samples processed so far are always a prefix of that order, so a count
(``processed_num``) is the whole progress. After a reset the rest of the epoch is dealt again
over the new world: nothing is repeated or skipped (except the padding that makes the shares
even, as with torch's DistributedSampler).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from hora.torch import _state


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Partition a dataset over the ranks and re-partition what is left after a reset.

    Include it in the :class:`~hora.torch.elastic.TorchState`, call :meth:`record_batch`
    after each batch and :meth:`set_epoch` at each new epoch; a reset then continues the
    epoch where the last commit left it.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the order (the same on every rank) each epoch.
        seed: the shuffle's seed, the same on every rank.

    Example:
        >>> sampler = hvd.elastic.ElasticSampler(dataset)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order, nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """Return the progress: the epoch and the number of its samples processed."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` and deal the rest of that epoch over the current world."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Deal what is left of the epoch over the current world (its size and this rank)."""
        st = _state.current()
        self.num_replicas, self.rank = (st.size, st.rank) if st is not None else (1, 0)
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        rest = list(self.remaining_indices)
        rest += rest[: self.total_size - len(rest)]  # pad so that every rank gets as many
        self.indices = rest[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
