"""trainer.data: the sample order depends only on (seed, consumed samples)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from trainer.config import DataConfig
from trainer.data import BatchReader, SampleOrder, SyntheticTokens, TokenFile, open_source
from wire.errors import DataError


def synthetic(seed: int = 7, num_samples: int = 50) -> SyntheticTokens:
    return SyntheticTokens(seed=seed, vocab_size=32, seq_len=8, num_samples=num_samples)


def test_each_epoch_visits_every_sample_once_in_a_seeded_order() -> None:
    order = SampleOrder(seed=1, num_samples=10)
    epoch0, epoch1 = order.indices(0, 10), order.indices(10, 10)
    assert sorted(epoch0) == list(range(10)) == sorted(epoch1)
    assert list(epoch0) != list(epoch1)
    assert list(SampleOrder(seed=2, num_samples=10).indices(0, 10)) != list(epoch0)


def test_order_depends_only_on_the_position_not_on_history() -> None:
    whole = SampleOrder(seed=3, num_samples=7).indices(0, 40)  # crosses five epochs
    pieces = [SampleOrder(seed=3, num_samples=7).indices(start, 5) for start in range(0, 40, 5)]
    assert list(np.concatenate(pieces)) == list(whole)
    fresh = SampleOrder(seed=3, num_samples=7)
    assert list(fresh.indices(33, 7)) == list(whole[33:40])


def test_a_resumed_reader_sees_the_batches_of_an_uninterrupted_one() -> None:
    source = synthetic()
    uninterrupted = BatchReader(source, seed=11, global_batch=6, rank=1, world_size=2)
    seen = [uninterrupted.rank_batch(step * 6) for step in range(20)]
    resumed = BatchReader(synthetic(), seed=11, global_batch=6, rank=1, world_size=2)
    for step in range(12, 20):  # a new process resuming at consumed = 72
        np.testing.assert_array_equal(resumed.rank_batch(step * 6), seen[step])


def test_ranks_split_the_global_batch_whatever_the_world_size() -> None:
    source = synthetic()
    consumed = 18

    def global_rows(world: int) -> np.ndarray:
        readers = [BatchReader(source, seed=5, global_batch=12, rank=r, world_size=world)
                   for r in range(world)]
        return np.concatenate([reader.rank_batch(consumed) for reader in readers])

    np.testing.assert_array_equal(global_rows(1), global_rows(4))
    indices = [BatchReader(source, seed=5, global_batch=12, rank=r, world_size=3)
               .rank_indices(consumed) for r in range(3)]
    assert len(set(np.concatenate(indices))) == 12  # disjoint slices within an epoch


def test_synthetic_tokens_are_deterministic_and_learnable() -> None:
    a, b = synthetic(seed=1), synthetic(seed=1)
    rows = a.samples(np.arange(50))
    np.testing.assert_array_equal(rows, b.samples(np.arange(50)))
    assert rows.shape == (50, 9) and rows.min() >= 0 and rows.max() < 32
    assert not np.array_equal(rows, synthetic(seed=2).samples(np.arange(50)))
    # Markov chain with 4 successors per token: a token is followed by at most 4 others.
    big = SyntheticTokens(seed=1, vocab_size=32, seq_len=64, num_samples=200)
    all_rows = big.samples(np.arange(200))
    pairs = {(int(x), int(y)) for row in all_rows for x, y in itertools.pairwise(row)}
    successors = {x: {y for p, y in pairs if p == x} for x, _ in pairs}
    assert max(len(s) for s in successors.values()) <= 4


def write_tokens(path: Path, tokens: list[int], dtype: str = "uint16") -> Path:
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def test_token_file_windows_overlap_by_one_token(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", list(range(11)), "uint32")
    source = TokenFile(path, dtype="uint32", seq_len=4, vocab_size=100)
    assert source.num_samples == 2  # (11 - 1) // 4
    np.testing.assert_array_equal(source.samples(np.array([1, 0])),
                                  [[4, 5, 6, 7, 8], [0, 1, 2, 3, 4]])


def test_token_file_problems_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        TokenFile(tmp_path / "missing.bin", dtype="uint16", seq_len=4, vocab_size=10)
    short = write_tokens(tmp_path / "short.bin", [1, 2, 3])
    with pytest.raises(DataError, match="fewer than one sample"):
        TokenFile(short, dtype="uint16", seq_len=4, vocab_size=10)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="not a whole number"):
        TokenFile(odd, dtype="uint16", seq_len=1, vocab_size=10)
    big = write_tokens(tmp_path / "big.bin", [1, 2, 3, 4, 99])
    source = TokenFile(big, dtype="uint16", seq_len=4, vocab_size=10)
    with pytest.raises(DataError, match="token id 99 >= vocab size 10"):
        source.samples(np.array([0]))


def test_open_source_picks_the_kind(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", list(range(20)))
    tokens = open_source(DataConfig(kind="tokens", path=str(path)), seed=0, vocab_size=32,
                         seq_len=4)
    assert isinstance(tokens, TokenFile)
    assert isinstance(open_source(DataConfig(num_samples=3), seed=0, vocab_size=32,
                                  seq_len=4), SyntheticTokens)
