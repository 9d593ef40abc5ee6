"""Elastic, resumable data sampler.

Each epoch is one fixed permutation ``perm`` of the dataset's positions. Training
consumes ``perm`` strictly from the front, so progress is just one integer,
``processed``. That keeps the state O(1) and lets a job with any number of ranks
pick up where a job with a different number of ranks left off.

The unconsumed tail ``rem = perm[processed:]`` is dealt out round-robin: rank
``r`` of ``s`` gets ``rem[r::s]``. All ranks step in lockstep with the same batch
size, so once each rank has consumed ``k`` of its own samples, the consumed set is
exactly ``rem[:k * s]``. It is still a prefix, and ``processed`` only moves ahead.

Constant-global-batch mode (``global_batch_size=G``): ``perm`` is cut into global
batches of ``G`` consecutive positions, ``perm[p:p + G]``, one per optimizer step,
whatever the world size. Each batch is dealt round-robin to the current ranks
(shares differ by at most one sample), and progress moves one whole global batch
at a time, so a membership change at a commit leaves the next global batch as it
was. An epoch whose length is not a multiple of ``G`` ends with a batch padded by
wrapping to the start of ``perm`` (or, with ``drop_last``, without the tail).
See :mod:`elastic.global_batch` for the training loop.
"""

from __future__ import annotations

import importlib.util
import math
import random
from collections.abc import Iterator, Sequence, Sized
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, Sampler

if TYPE_CHECKING:
    from elastic.training.global_batch import GlobalBatch


def _current_rank_size() -> tuple[int, int]:
    """Ask the elastic runtime which rank we are and how many ranks there are."""
    try:
        from elastic.worker import runtime
    except ImportError:
        # Only a missing runtime module means "no elastic runtime": run as one rank.
        # An import error raised inside an existing runtime still propagates.
        if importlib.util.find_spec("elastic.worker.runtime") is not None:
            raise
        return 0, 1
    return int(runtime.rank()), int(runtime.size())


class ElasticSampler(Sampler):
    """Shards a map-style dataset over a changing set of ranks, each sample once per epoch.

    After a membership change the framework calls :meth:`reset`, which counts this
    rank's progress as global progress and splits what is left among the new ranks.
    A restarted job resumes from :meth:`state_dict`, which holds four scalars.

    ``drop_last=False`` pads the epoch's last batch by repeating samples from the
    start of the remaining permutation; ``drop_last=True`` leaves out the tail
    that cannot be split evenly. With ``global_batch_size=G`` every optimizer
    step covers exactly ``G`` samples whatever the world size: iterate with
    :meth:`global_batches` and call :meth:`record_global_batch` after each step.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 global_batch_size: int | None = None) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "ElasticSampler needs a map-style dataset with a fixed length; "
                f"got IterableDataset {type(dataset).__name__}")
        try:
            length = len(dataset)
        except TypeError:
            raise TypeError(
                "ElasticSampler needs a dataset that defines __len__; "
                f"{type(dataset).__name__} does not") from None
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        if global_batch_size is not None and (
                isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int)
                or global_batch_size < 1):
            raise ValueError(f"global_batch_size must be an int >= 1 or None, "
                             f"not {global_batch_size!r}")
        self.global_batch_size = global_batch_size
        self._len = int(length)
        self.epoch = 0
        self.processed = 0      # consumed prefix of perm, as of the last reset/load
        self._local = 0         # samples this rank consumed since then (global batches, in
                                # global-batch mode)
        self._rank, self._size = 0, 1
        # (epoch, seed, shuffle, order, id(head), perm); derived, never saved
        self._perm_cache: tuple[int, int, bool, str, int, torch.Tensor] | None = None
        self._order = "torch"    # "horovod": the permutation of a state dict saved by Horovod
        # (epoch, indices): processed first in that epoch (Horovod's older format saved a
        # set of processed indices)
        self._head: tuple[int, list[int]] | None = None
        self.indices: list[int] = []   # what the last __iter__ handed out, as in Horovod
        self._indices: list[int] = []
        self._batches = 0        # global-batch mode: global batches left as of the last reset
        self.reset()

    # -- the split, under Horovod's names too ------------------------------------

    @property
    def rank(self) -> int:
        """The rank this sampler hands samples to (as of the last reset)."""
        return self._rank

    @property
    def size(self) -> int:
        """The world size it splits the epoch over (as of the last reset)."""
        return self._size

    @property
    def length(self) -> int:
        """Samples in the dataset: an epoch's permutation is this long."""
        return self._len

    @property
    def num_replicas(self) -> int:
        """Horovod's name for ``size``."""
        return self._size

    @property
    def num_samples(self) -> int:
        """This rank's share of the epoch as of the last reset: ``len(sampler)``."""
        return len(self._indices)

    @property
    def total_size(self) -> int:
        """``num_samples`` times ``num_replicas``: the remaining samples, padded to split evenly."""
        return self.num_samples * self._size

    @property
    def remaining_indices(self) -> list[int]:
        """The dataset indices no rank had consumed at the last reset, in epoch order."""
        return self._perm()[self.processed:].tolist()

    @property
    def processed_indices(self) -> set[int]:
        """The dataset indices consumed so far this epoch (a set, as in Horovod)."""
        return set(self._perm()[: self.processed_num].tolist())

    # -- progress bookkeeping -------------------------------------------------

    @property
    def processed_num(self) -> int:
        """Global progress: the length of the consumed prefix of this epoch's permutation."""
        step = self.global_batch_size or self._size   # in global-batch mode _local counts batches
        return min(self._len, self.processed + self._local * step)

    @property
    def remaining(self) -> int:
        """Samples of this epoch that no rank has consumed yet."""
        return self._len - self.processed_num

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a finished batch of ``batch_size`` samples. ``batch_idx`` is ignored
        and only kept so the call matches other samplers' API."""
        self._advance(int(batch_size))

    def record_indices(self, indices: Sized) -> None:
        """Count a finished batch given by the indices it used."""
        self._advance(len(indices))

    def record_global_batch(self) -> None:
        """Count one finished global batch (an optimizer step) in global-batch mode.

        Call it after ``optimizer.step()`` and before ``state.commit()``, on every rank."""
        if not self.global_batch_size:
            raise RuntimeError("record_global_batch() needs ElasticSampler(global_batch_size=...); "
                               "use record_batch() or record_indices() otherwise")
        self._local = min(self._local + 1, self._batches)

    @property
    def global_batches_left(self) -> int:
        """Global-batch mode: optimizer steps left in this epoch."""
        if not self.global_batch_size:
            raise RuntimeError("global_batches_left needs ElasticSampler(global_batch_size=...)")
        return self._batches - self._local

    def global_batches(self, optimizer: object,
                       micro_batch_size: int | None = None) -> Iterator[GlobalBatch]:
        """Global-batch mode: yield one :class:`elastic.global_batch.GlobalBatch` per
        optimizer step left in this epoch. See :mod:`elastic.global_batch`."""
        from elastic.training.global_batch import iterate_global_batches
        return iterate_global_batches(self, optimizer, micro_batch_size)

    def _advance(self, count: int) -> None:
        if self.global_batch_size:
            raise RuntimeError("in global-batch mode progress moves one global batch at a time: "
                               "call record_global_batch() after each optimizer step")
        if count < 0:
            raise ValueError(f"cannot record a negative number of samples ({count})")
        # A short last batch may be recorded at its nominal size. Capping at this
        # rank's share means progress never counts samples that were not handed out.
        self._local = min(self._local + count, len(self._indices))

    # -- membership / epoch changes -------------------------------------------

    def reset(self, rank: int | None = None, size: int | None = None) -> None:
        """Count local progress as global progress and split the rest among the current ranks.

        The framework calls this after every membership change. ``rank`` and ``size``
        replace the runtime's values, so tests can simulate ranks in one process.
        """
        self.processed = self.processed_num
        self._local = 0
        if rank is None or size is None:
            cur_rank, cur_size = _current_rank_size()
            rank = cur_rank if rank is None else rank
            size = cur_size if size is None else size
        rank, size = int(rank), int(size)
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for size {size}")
        self._rank, self._size = rank, size
        self._recompute()

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch``. A different epoch starts with no progress. The same
        epoch keeps its progress, so calling ``set_epoch(state.epoch)`` after a
        restore resumes mid-epoch and does not train on samples again."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed = 0
            self._head = None
        else:
            self.processed = self.processed_num
        self._local = 0
        self._recompute()

    def state_dict(self) -> dict[str, Any]:
        """Return the full sampler state: four scalars, with no index lists (plus the
        order and processed head of a state loaded from Horovod, while they matter)."""
        sd: dict[str, Any] = {"epoch": self.epoch, "processed": self.processed_num,
              "seed": self.seed, "shuffle": self.shuffle}
        if self._order != "torch":
            sd["order"] = self._order
        if self._head is not None and self._head[0] == self.epoch:
            sd["head"] = list(self._head[1])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the progress in ``state_dict`` and split what is left among the
        current ranks. Seed and shuffle are restored as well, because the saved
        progress only makes sense with the same permutation.

        A state dict saved by Horovod's ElasticSampler (``epoch`` and
        ``processed_num``, or the older ``processed_indices``) loads too: the
        sampler then uses Horovod's permutation of the epoch, so exactly the
        samples Horovod had not yet trained come next.
        """
        if "processed" not in state_dict:
            state_dict = self._from_horovod(state_dict)
        self._order = state_dict.get("order", "torch")
        if self._order not in ("torch", "horovod"):
            raise ValueError(f"unknown sampler order {self._order!r}")
        head = state_dict.get("head")
        self._head = (int(state_dict["epoch"]), [int(i) for i in head]) if head else None
        processed = int(state_dict["processed"])
        if not 0 <= processed <= self._len:
            raise ValueError(
                f"processed={processed} is outside [0, {self._len}]; "
                "was the state saved for a different dataset?")
        self.epoch = int(state_dict["epoch"])
        self.seed = int(state_dict.get("seed", self.seed))
        self.shuffle = bool(state_dict.get("shuffle", self.shuffle))
        self.processed = processed
        self._local = 0
        self._recompute()

    def _from_horovod(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our form of a Horovod state dict: {epoch, processed_num} or {epoch, processed_indices}."""
        if "epoch" not in state_dict or not ("processed_num" in state_dict
                                             or "processed_indices" in state_dict):
            raise ValueError("not a sampler state dict: it needs epoch and processed "
                             "(or Horovod's processed_num / processed_indices)")
        out: dict[str, Any] = {"epoch": int(state_dict["epoch"]), "order": "horovod"}
        if "processed_num" in state_dict:
            out["processed"] = int(state_dict["processed_num"])
            return out
        done = sorted({int(i) for i in state_dict["processed_indices"]})
        if any(not 0 <= i < self._len for i in done):
            raise ValueError("processed_indices holds indices outside the dataset; "
                             "was the state saved for a different dataset?")
        out["processed"], out["head"] = len(done), done
        return out

    # -- index computation -----------------------------------------------------

    def _perm(self) -> torch.Tensor:
        head = self._head[1] if self._head is not None and self._head[0] == self.epoch else None
        key = (self.epoch, self.seed, self.shuffle, self._order, id(head))
        if self._perm_cache is None or self._perm_cache[:5] != key:
            if not self.shuffle:
                perm = torch.arange(self._len)
            elif self._order == "horovod":   # Horovod shuffles with Python's random
                order = list(range(self._len))
                random.Random(self.seed + self.epoch).shuffle(order)
                perm = torch.tensor(order, dtype=torch.int64)
            else:
                gen = torch.Generator()
                gen.manual_seed(self.seed + self.epoch)
                perm = torch.randperm(self._len, generator=gen)
            if head:   # the processed set first, then the rest in permutation order
                first = torch.tensor(head, dtype=torch.int64)
                rest = torch.ones(self._len, dtype=torch.bool)
                rest[first] = False
                perm = torch.cat([first, perm[rest[perm]]])
            self._perm_cache = key + (perm,)
        return self._perm_cache[5]

    def _recompute(self) -> None:
        if self.global_batch_size:
            self._recompute_global()
            return
        rem = self._perm()[self.processed:]
        m, s = len(rem), self._size
        per = m // s if self.drop_last else math.ceil(m / s)
        if per == 0:
            self._indices = []
            return
        # Position j*s + r of rem goes to rank r. Positions past the end wrap to the
        # start of rem, so short ranks are padded only at the end of the epoch.
        pos = torch.arange(per) * s + self._rank
        self._indices = rem[pos % m].tolist()

    def _recompute_global(self) -> None:
        g, m = self.global_batch_size, self._len - self.processed
        if g is None:     # _recompute calls this in global-batch mode only
            raise RuntimeError("a global batch split needs ElasticSampler(global_batch_size=...)")
        self._batches = m // g if self.drop_last else -(-m // g)
        if self._batches == 0:
            self._indices = []
            return
        # Row b is global batch b: positions processed + b*g ... (+ g - 1), wrapping to
        # the start of the epoch's permutation to pad the last one. Columns are dealt
        # round-robin, so this rank's share of every batch is column r, r + s, ...
        pos = self.processed + torch.arange(self._batches * g).view(self._batches, g)
        self._indices = self._perm()[pos % self._len][:, self._rank::self._size].flatten().tolist()

    def global_batch_indices(self, number: int) -> list[int]:
        """Global-batch mode: all ``G`` indices of global batch ``number`` of the rest of
        this epoch (0 is the next one), the same on every rank and at every world size."""
        if not 0 <= number < self._batches - self._local:
            raise IndexError(f"global batch {number} is past the end of the epoch")
        g = self.global_batch_size
        if g is None:     # outside global-batch mode no batch is left: the check above raised
            raise RuntimeError("global_batch_indices() needs ElasticSampler(global_batch_size=...)")
        start = self.processed + (self._local + number) * g
        return self._perm()[torch.arange(start, start + g) % self._len].tolist()

    def share_of(self, indices: Sequence[int], rank: int | None = None,
                 size: int | None = None) -> list[int]:
        """The part of a global batch that ``rank`` of ``size`` trains (default: this rank)."""
        rank = self._rank if rank is None else int(rank)
        size = self._size if size is None else int(size)
        return list(indices[rank::size])

    # -- Sampler protocol ------------------------------------------------------

    def get_indices(self, batch_idx: int, batch_size: int) -> list:
        """Return this rank's indices for batch ``batch_idx``, counted from the last reset.
        (In global-batch mode this slices the concatenation of this rank's shares.)"""
        start = int(batch_idx) * int(batch_size)
        return self._indices[start:start + int(batch_size)]

    def __iter__(self) -> Iterator[int]:
        # Iterate over a snapshot: record_batch during the loop must not shift it.
        self.indices = list(self._indices)
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self._indices)
