"""Deterministic training data: which samples a rank sees depends only on
(seed, consumed samples, global batch size, world size, rank).

The data set is ``num_samples`` fixed sequences of ``seq_len + 1`` tokens (inputs plus
the next-token targets). They are read as one endless stream: epoch ``e`` visits every
sample once in the order of a permutation seeded by (seed, e). Stream position ``p``
is sample ``perm(seed, p // num_samples)[p % num_samples]``.

An optimizer step that starts after ``consumed`` samples takes stream positions
``[consumed, consumed + global_batch)``; rank ``r`` takes the ``r``-th of ``world_size``
equal consecutive slices. A checkpoint stores ``consumed``, so a resumed run sees
exactly the batches a fault-free run would have seen, with no iterator state to save.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from trainer.config import DataConfig
from trainer.errors import DataError

TokenArray = npt.NDArray[np.int64]

# SeedSequence spawn keys keep the data streams independent of each other and of the
# model's init (which seeds by parameter name).
_STREAM_GENERATE = 1
_STREAM_ORDER = 2

# The synthetic Markov chain: every token has this many possible successors, picked with
# these probabilities. The entropy of the choice, about 1.17 nats, is the loss floor.
_SUCCESSOR_PROBS = np.array([0.6, 0.2, 0.1, 0.1])


class TokenSource(Protocol):
    """A fixed, indexable set of sequences of ``seq_len + 1`` token ids."""

    @property
    def num_samples(self) -> int: ...

    def samples(self, indices: npt.NDArray[np.int64]) -> TokenArray:
        """Rows for the given sample indices, shape (len(indices), seq_len + 1)."""
        ...


class SyntheticTokens:
    """Sequences from a random first-order Markov chain, generated in memory from the seed.

    The chain is learnable (each token has only a few likely successors), so the loss
    falls from ln(vocab) towards the chain's entropy, which makes training progress and
    loss spikes visible in tests without downloading a corpus.
    """

    def __init__(self, *, seed: int, vocab_size: int, seq_len: int, num_samples: int) -> None:
        rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM_GENERATE]))
        successors = rng.integers(0, vocab_size, size=(vocab_size, len(_SUCCESSOR_PROBS)))
        tokens = np.empty((num_samples, seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, vocab_size, size=num_samples)
        cumulative = np.cumsum(_SUCCESSOR_PROBS)
        for pos in range(1, seq_len + 1):
            # One draw per sample: which of the previous token's successors comes next.
            choice = np.searchsorted(cumulative, rng.random(num_samples), side="right")
            choice = np.minimum(choice, len(_SUCCESSOR_PROBS) - 1)  # guard u == 1.0 rounding
            tokens[:, pos] = successors[tokens[:, pos - 1], choice]
        self._tokens = tokens

    @property
    def num_samples(self) -> int:
        return int(self._tokens.shape[0])

    def samples(self, indices: npt.NDArray[np.int64]) -> TokenArray:
        rows: TokenArray = self._tokens[indices]
        return rows


class TokenFile:
    """A flat binary file of token ids, read through a memory map.

    Sample ``i`` is tokens ``[i * seq_len, i * seq_len + seq_len + 1)``: consecutive
    windows share one token, so every token is a target exactly once.
    """

    def __init__(self, path: Path, *, dtype: str, seq_len: int, vocab_size: int) -> None:
        if not path.is_file():
            raise DataError(f"data.path: no such file: {path}")
        itemsize = np.dtype(dtype).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise DataError(f"data.path: {path} is {size} bytes, not a whole number of "
                            f"{dtype} tokens")
        self._tokens = np.memmap(path, dtype=dtype, mode="r")
        self._seq_len, self._vocab_size, self._path = seq_len, vocab_size, path
        if self.num_samples < 1:
            raise DataError(f"data.path: {path} holds {len(self._tokens)} tokens, fewer "
                            f"than one sample of seq_len + 1 = {seq_len + 1}")

    @property
    def num_samples(self) -> int:
        return (len(self._tokens) - 1) // self._seq_len

    def samples(self, indices: npt.NDArray[np.int64]) -> TokenArray:
        starts = indices * self._seq_len
        offsets = np.arange(self._seq_len + 1)
        rows: TokenArray = self._tokens[starts[:, None] + offsets[None, :]].astype(np.int64)
        if rows.size and int(rows.max()) >= self._vocab_size:
            raise DataError(f"data.path: {self._path} has token id {int(rows.max())} >= "
                            f"vocab size {self._vocab_size}")
        return rows


def open_source(config: DataConfig, *, seed: int, vocab_size: int, seq_len: int) -> TokenSource:
    if config.kind == "synthetic":
        return SyntheticTokens(seed=seed, vocab_size=vocab_size, seq_len=seq_len,
                               num_samples=config.num_samples)
    assert config.path is not None  # DataConfig guarantees it for kind = "tokens"
    return TokenFile(Path(config.path), dtype=config.dtype, seq_len=seq_len,
                     vocab_size=vocab_size)


class SampleOrder:
    """Maps stream positions to sample indices (epoch-wise seeded permutations)."""

    def __init__(self, *, seed: int, num_samples: int) -> None:
        self._seed, self._num_samples = seed, num_samples
        self._cached_epoch = -1
        self._cached_perm: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        if epoch != self._cached_epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self._seed, _STREAM_ORDER,
                                                                epoch]))
            self._cached_perm = rng.permutation(self._num_samples).astype(np.int64)
            self._cached_epoch = epoch
        return self._cached_perm

    def indices(self, start: int, count: int) -> npt.NDArray[np.int64]:
        """Sample indices at stream positions ``[start, start + count)``."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:  # a range may cross one or more epoch boundaries
            position = start + filled
            epoch, offset = divmod(position, self._num_samples)
            take = min(count - filled, self._num_samples - offset)
            out[filled:filled + take] = self.permutation(epoch)[offset:offset + take]
            filled += take
        return out


class BatchReader:
    """One rank's view: the rows it trains on in the step that starts at ``consumed``."""

    def __init__(self, source: TokenSource, *, seed: int, global_batch: int, rank: int,
                 world_size: int) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} not divisible by {world_size}")
        self._source = source
        self._order = SampleOrder(seed=seed, num_samples=source.num_samples)
        self._global_batch = global_batch
        self._per_rank = global_batch // world_size
        self._rank = rank

    @property
    def global_batch(self) -> int:
        return self._global_batch

    def rank_indices(self, consumed: int) -> npt.NDArray[np.int64]:
        start = consumed + self._rank * self._per_rank
        return self._order.indices(start, self._per_rank)

    def rank_batch(self, consumed: int) -> TokenArray:
        """Rows (per_rank, seq_len + 1) of this rank for the step starting at ``consumed``."""
        return self._source.samples(self.rank_indices(consumed))
