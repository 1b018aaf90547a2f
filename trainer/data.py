"""Deterministic training data: which samples a rank sees depends only on
(seed, consumed samples, global batch size, world size, rank).

The data set is ``num_samples`` fixed sequences of ``seq_len + 1`` tokens (inputs plus
the next-token targets). They are read as one endless stream: epoch ``e`` visits every
sample once in the order of a permutation seeded by (seed, e). Stream position ``p``
is sample ``perm(seed, p // num_samples)[p % num_samples]``.

An optimizer step that starts after ``consumed`` samples takes stream positions
``[consumed, consumed + global_batch)``; rank ``r`` takes the ``r``-th of ``world_size``
equal consecutive slices. A checkpoint stores ``consumed``, so a resumed run sees
exactly the batches a fault-free run would have seen, with no iterator state to save,
and the samples of a step are the same whatever the world size.

The kinds (``data.kind``): ``synthetic`` and ``tokens`` here; ``arrow`` (token ids) and
``text`` (raw text, tokenized at start) are document data sets packed into samples by
trainer.packing. A streamed data set (``data.streaming``) has no sample indices: it maps
stream positions to samples itself (a TokenStream), with the same rank split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from trainer.config import DataConfig
from trainer.packing import open_packed, open_streamed
from wire.errors import DataError

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


@runtime_checkable
class TokenStream(Protocol):
    """Samples already in training order, addressed by stream position (samples consumed)."""

    def rows(self, start: int, count: int) -> TokenArray:
        """Rows at stream positions ``[start, start + count)``, shape (count, seq_len + 1)."""
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


class SampleRange:
    """Samples ``[first, first + count)`` of another source, numbered from 0."""

    def __init__(self, source: TokenSource, *, first: int, count: int) -> None:
        self.source, self._first, self._count = source, first, count

    @property
    def num_samples(self) -> int:
        return self._count

    def samples(self, indices: npt.NDArray[np.int64]) -> TokenArray:
        return self.source.samples(indices + self._first)


def _open_indexed(config: DataConfig, path: str | None, *, seed: int, vocab_size: int,
                  seq_len: int) -> TokenSource:
    if config.kind == "synthetic":
        return SyntheticTokens(seed=seed, vocab_size=vocab_size, seq_len=seq_len,
                               num_samples=config.num_samples)
    assert path is not None  # DataConfig requires data.path for the other kinds
    if config.kind == "tokens":
        return TokenFile(Path(path), dtype=config.dtype, seq_len=seq_len, vocab_size=vocab_size)
    return open_packed(Path(path), kind=config.kind, column=config.document_column(),
                       tokenizer=_tokenizer_path(config), eos_id=config.eos_id,
                       seq_len=seq_len, vocab_size=vocab_size)


def _tokenizer_path(config: DataConfig) -> Path | None:
    return None if config.tokenizer is None else Path(config.tokenizer)


def _held_out(config: DataConfig, source: TokenSource) -> int:
    """How many samples at the end of ``source`` data.validation_fraction keeps for validation."""
    if not config.validation_fraction:
        return 0
    total = source.num_samples
    held = max(1, int(total * config.validation_fraction))
    if held >= total:
        raise DataError(f"data.validation_fraction: {config.validation_fraction} of {total} "
                        f"samples leaves none to train on")
    return held


def open_source(config: DataConfig, *, seed: int, vocab_size: int,
                seq_len: int) -> TokenSource | TokenStream:
    """The training data: every sample but those data.validation_fraction holds out."""
    if config.streaming:
        assert config.path is not None  # DataConfig allows streaming for arrow and text only
        return open_streamed(Path(config.path), kind=config.kind,
                             column=config.document_column(),
                             tokenizer=_tokenizer_path(config), eos_id=config.eos_id, seed=seed,
                             seq_len=seq_len, vocab_size=vocab_size,
                             shuffle_block=config.shuffle_block)
    source = _open_indexed(config, config.path, seed=seed, vocab_size=vocab_size, seq_len=seq_len)
    held = _held_out(config, source)
    return SampleRange(source, first=0, count=source.num_samples - held) if held else source


def open_validation_source(config: DataConfig, *, seed: int, vocab_size: int, seq_len: int,
                           training: TokenSource | TokenStream | None = None) -> TokenSource | None:
    """Held-out samples for validation, never trained on; None when the config names none.

    They are data.validation_path's samples (the same kind, column and tokenizer as the
    training data), or the last data.validation_fraction of the training set's. Read
    them in index order, ``samples(np.arange(n))``: all ranks see the same rows. With a
    fraction, ``training`` (what open_source returned) lends its opened set, so that it
    is not opened (a ``text`` set not tokenized) a second time.
    """
    if config.validation_path is not None:
        return _open_indexed(config, config.validation_path, seed=seed,
                             vocab_size=vocab_size, seq_len=seq_len)
    if not config.validation_fraction:
        return None
    source = (training.source if isinstance(training, SampleRange)
              else _open_indexed(config, config.path, seed=seed, vocab_size=vocab_size, seq_len=seq_len))
    held = _held_out(config, source)
    return SampleRange(source, first=source.num_samples - held, count=held)


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


class OrderedSamples:
    """An indexed source read in SampleOrder's seeded epoch order (a TokenStream)."""

    def __init__(self, source: TokenSource, *, seed: int) -> None:
        self.source = source
        self.order = SampleOrder(seed=seed, num_samples=source.num_samples)

    def rows(self, start: int, count: int) -> TokenArray:
        return self.source.samples(self.order.indices(start, count))


class BatchReader:
    """One rank's view: the rows it trains on in the step that starts at ``consumed``."""

    def __init__(self, source: TokenSource | TokenStream, *, seed: int, global_batch: int,
                 rank: int, world_size: int) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} not divisible by {world_size}")
        # A streamed source orders its samples itself (seeded when it was opened).
        self._stream = source if isinstance(source, TokenStream) else OrderedSamples(source, seed=seed)
        self._global_batch = global_batch
        self._per_rank = global_batch // world_size
        self._rank = rank

    @property
    def global_batch(self) -> int:
        return self._global_batch

    def _first_position(self, consumed: int) -> int:
        return consumed + self._rank * self._per_rank

    def rank_indices(self, consumed: int) -> npt.NDArray[np.int64]:
        """Sample indices of this rank's rows (an indexed source's only)."""
        if not isinstance(self._stream, OrderedSamples):
            raise TypeError("a streamed data set has no sample indices")
        return self._stream.order.indices(self._first_position(consumed), self._per_rank)

    def rank_batch(self, consumed: int) -> TokenArray:
        """Rows (per_rank, seq_len + 1) of this rank for the step starting at ``consumed``."""
        return self._stream.rows(self._first_position(consumed), self._per_rank)
