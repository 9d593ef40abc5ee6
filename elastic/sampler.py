"""Elastic, resumable data sampler.

Each epoch is one fixed permutation ``perm`` of the dataset's positions. Training
consumes ``perm`` strictly from the front, so progress is just one integer,
``processed``. That keeps the state O(1) and lets a job with any number of ranks
pick up where a job with a different number of ranks left off.

The unconsumed tail ``rem = perm[processed:]`` is dealt out round-robin: rank
``r`` of ``s`` gets ``rem[r::s]``. All ranks step in lockstep with the same batch
size, so once each rank has consumed ``k`` of its own samples, the consumed set is
exactly ``rem[:k * s]``. It is still a prefix, and ``processed`` only moves ahead.
"""

import importlib.util
import math

import torch
from torch.utils.data import IterableDataset, Sampler


def _current_rank_size():
    """Ask the elastic runtime which rank we are and how many ranks there are."""
    try:
        from elastic import runtime
    except ImportError:
        # Only a missing runtime module means "no elastic runtime": run as one rank.
        # An import error raised inside an existing runtime still propagates.
        if importlib.util.find_spec("elastic.runtime") is not None:
            raise
        return 0, 1
    return int(runtime.rank()), int(runtime.size())


class ElasticSampler(Sampler):
    """Shards a map-style dataset over a changing set of ranks, each sample once per epoch.

    After a membership change the framework calls :meth:`reset`, which counts this
    rank's progress as global progress and splits what is left among the new ranks.
    A restarted job resumes from :meth:`state_dict`, which holds four scalars.
    """

    def __init__(self, dataset, shuffle=True, seed=0, drop_last=False):
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
        self._len = int(length)
        self.epoch = 0
        self.processed = 0      # consumed prefix of perm, as of the last reset/load
        self._local = 0         # samples this rank has consumed since then
        self._rank, self._size = 0, 1
        self._perm_cache = None  # (epoch, seed, shuffle, perm); derived, never saved
        self._indices = []
        self.reset()

    # -- progress bookkeeping -------------------------------------------------

    @property
    def processed_num(self):
        """Global progress: the length of the consumed prefix of this epoch's permutation."""
        return min(self._len, self.processed + self._local * self._size)

    @property
    def remaining(self):
        """Samples of this epoch that no rank has consumed yet."""
        return self._len - self.processed_num

    def record_batch(self, batch_idx, batch_size):
        """Count a finished batch of ``batch_size`` samples. ``batch_idx`` is ignored
        and only kept so the call matches other samplers' API."""
        self._advance(int(batch_size))

    def record_indices(self, indices):
        """Count a finished batch given by the indices it used."""
        self._advance(len(indices))

    def _advance(self, count):
        if count < 0:
            raise ValueError(f"cannot record a negative number of samples ({count})")
        # A short last batch may be recorded at its nominal size. Capping at this
        # rank's share means progress never counts samples that were not handed out.
        self._local = min(self._local + count, len(self._indices))

    # -- membership / epoch changes -------------------------------------------

    def reset(self, rank=None, size=None):
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

    def set_epoch(self, epoch):
        """Switch to ``epoch``. A different epoch starts with no progress. The same
        epoch keeps its progress, so calling ``set_epoch(state.epoch)`` after a
        restore resumes mid-epoch and does not train on samples again."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed = 0
        else:
            self.processed = self.processed_num
        self._local = 0
        self._recompute()

    def state_dict(self):
        """Return the full sampler state: four scalars, with no index lists."""
        return {"epoch": self.epoch, "processed": self.processed_num,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state_dict):
        """Restore the progress in ``state_dict`` and split what is left among the
        current ranks. Seed and shuffle are restored as well, because the saved
        progress only makes sense with the same permutation."""
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

    # -- index computation -----------------------------------------------------

    def _perm(self):
        key = (self.epoch, self.seed, self.shuffle)
        if self._perm_cache is None or self._perm_cache[:3] != key:
            if self.shuffle:
                gen = torch.Generator()
                gen.manual_seed(self.seed + self.epoch)
                perm = torch.randperm(self._len, generator=gen)
            else:
                perm = torch.arange(self._len)
            self._perm_cache = key + (perm,)
        return self._perm_cache[3]

    def _recompute(self):
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

    # -- Sampler protocol ------------------------------------------------------

    def get_indices(self, batch_idx, batch_size):
        """Return this rank's indices for batch ``batch_idx``, counted from the last reset."""
        start = int(batch_idx) * int(batch_size)
        return self._indices[start:start + int(batch_size)]

    def __iter__(self):
        # Iterate over a snapshot: record_batch during the loop must not shift it.
        return iter(list(self._indices))

    def __len__(self):
        return len(self._indices)
