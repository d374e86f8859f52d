"""A single-process data loader whose position can be saved and restored for exact resume.

The driver owns the loader; its ``state_dict()`` goes into the trainer checkpoint, and a
run restarted from that checkpoint sees exactly the batches the interrupted run would have.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["StatefulDataLoader", "StatefulSampler"]


class StatefulSampler:
    """Batches of indices, reshuffled every epoch, whose position can be saved and restored.

    The order of epoch ``e`` depends only on ``(seed, e)``, so a restored sampler continues
    with exactly the batches the original would have produced.

    Args:
        num_samples: dataset size.
        batch_size: indices per batch.
        shuffle: permute each epoch (else dataset order).
        seed: shuffling seed.
        drop_last: drop the final incomplete batch of an epoch.

    >>> sampler = StatefulSampler(5, batch_size=2, shuffle=False, drop_last=False)
    >>> list(sampler)
    [[0, 1], [2, 3], [4]]
    """

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if batch_size < 1 or num_samples < 0:
            raise ValueError(f"batch_size={batch_size} must be >= 1 and num_samples={num_samples} >= 0")
        if drop_last and num_samples < batch_size:
            raise ValueError(f"num_samples={num_samples} < batch_size={batch_size} with drop_last: no batch at all")
        self.num_samples, self.batch_size, self.shuffle, self.seed, self.drop_last = (
            num_samples, batch_size, shuffle, seed, drop_last,
        )  # fmt: skip
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples).tolist()

    def __iter__(self):
        """Yield the remaining batches of the current epoch, then move to the next epoch."""
        if self.position >= len(self):  # the previous loop stopped right after its last batch
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            self.position += 1  # counted before yielding: a state saved now excludes this batch
            yield order[start : start + self.batch_size]
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``epoch`` and ``position``; the other fields must match this sampler."""
        for key in ("seed", "num_samples", "batch_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class StatefulDataLoader:
    """Single-process loader over a map-style dataset with a resumable :class:`StatefulSampler`.

    Args:
        dataset: indexable items (``len`` and ``[i]``).
        batch_size: items per batch.
        collate_fn: list of items → batch; default ``dataset.collate``.
        shuffle: reshuffle each epoch.
        seed: shuffling seed.
        drop_last: drop the final incomplete batch of an epoch.

    ``for batch in loader`` runs the rest of the current epoch; ``state_dict()`` taken after
    any batch and loaded into a fresh loader continues with the next batch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if collate_fn is None and not hasattr(dataset, "collate"):
            raise ValueError(f"{type(dataset).__name__} has no collate(); pass collate_fn")
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else dataset.collate
        self.sampler = StatefulSampler(len(dataset), batch_size, shuffle, seed, drop_last)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __iter__(self):
        for indices in self.sampler:
            yield self.collate_fn([self.dataset[i] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)
