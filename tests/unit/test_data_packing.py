"""trainer.packing and the document kinds of trainer.data: packing, order, rank split, resume.

Every data set here is written by the test itself, small enough to check by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trainer.config import DataConfig, config_from_dict
from trainer.data import (
    BatchReader,
    SampleRange,
    TokenSource,
    TokenStream,
    open_source,
    open_validation_source,
)
from wire.errors import ConfigError, DataError

SEQ_LEN = 4
VOCAB = 64
EOS = 1
# Varied lengths: an empty document, one longer than a sample, one of a single token.
DOCUMENTS = [[2, 3, 4], [], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15], [16, 17]]
WORDS = ["<unk>", "</s>"] + [f"w{i}" for i in range(2, VOCAB)]  # token id i is word WORDS[i]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    datasets.disable_progress_bars()


def save_tokens(path: Path, documents: list[list[int]], num_shards: int = 2) -> Path:
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    datasets.Dataset.from_dict({"input_ids": documents}, features=features).save_to_disk(
        str(path), num_shards=num_shards)
    return path


def save_text(path: Path, documents: list[list[int]], num_shards: int = 2) -> Path:
    texts = [" ".join(WORDS[i] for i in document) for document in documents]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path), num_shards=num_shards)
    return path


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer: word ``w{i}`` is id i, ``</s>`` is id 1 (its EOS)."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def random_documents(seed: int, count: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=int(rng.integers(0, 12))).tolist() for _ in range(count)]


def config(**keys: Any) -> DataConfig:
    return DataConfig(**keys)


def open_(data: DataConfig, seed: int = 3) -> TokenSource | TokenStream:
    return open_source(data, seed=seed, vocab_size=VOCAB, seq_len=SEQ_LEN)


def all_rows(source: TokenSource | TokenStream) -> np.ndarray:
    assert not isinstance(source, TokenStream)
    return source.samples(np.arange(source.num_samples))


# ---- packing ------------------------------------------------------------------------------


def test_documents_are_concatenated_and_cut_into_windows_that_share_a_token(tmp_path: Path) -> None:
    source = open_(config(kind="arrow", path=str(save_tokens(tmp_path / "d", DOCUMENTS))))
    # The stream is 2..17 (16 tokens): three windows of 5; the last token pair is left over.
    np.testing.assert_array_equal(all_rows(source), [[2, 3, 4, 5, 6], [6, 7, 8, 9, 10],
                                                     [10, 11, 12, 13, 14]])


def test_eos_follows_every_non_empty_document(tmp_path: Path) -> None:
    path = save_tokens(tmp_path / "d", DOCUMENTS)
    source = open_(config(kind="arrow", path=str(path), eos_id=EOS))
    # 2 3 4 E 5 ... 14 E 15 E 16 17 E: 20 tokens, the empty document adds no EOS.
    np.testing.assert_array_equal(all_rows(source), [
        [2, 3, 4, EOS, 5], [5, 6, 7, 8, 9], [9, 10, 11, 12, 13], [13, 14, EOS, 15, EOS]])


def test_a_directory_of_arrow_files_with_many_chunks_packs_the_same(tmp_path: Path) -> None:
    documents = random_documents(seed=1)
    saved = open_(config(kind="arrow", path=str(save_tokens(tmp_path / "saved", documents)),
                         eos_id=EOS))
    raw = tmp_path / "raw"
    raw.mkdir()
    kind = pa.list_(pa.int64())
    for name, part in (("a.arrow", documents[:25]), ("b.arrow", documents[25:])):
        batch_rows = [part[i:i + 7] for i in range(0, len(part), 7)]  # several record batches
        with pa.ipc.new_stream(str(raw / name), pa.schema([("input_ids", kind)])) as writer:
            for rows in batch_rows:
                writer.write_batch(pa.record_batch([pa.array(rows, type=kind)], names=["input_ids"]))
    files = open_(config(kind="arrow", path=str(raw), eos_id=EOS))
    assert files.num_samples == saved.num_samples > 20  # type: ignore[union-attr]
    np.testing.assert_array_equal(all_rows(files), all_rows(saved))


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    path = save_tokens(tmp_path / "d", [[2, 3, 4, 5, 6], [7, 80, 9, 10]], num_shards=1)
    source = open_(config(kind="arrow", path=str(path)))
    assert not isinstance(source, TokenStream)
    source.samples(np.array([0]))  # tokens 2..6 fit
    with pytest.raises(DataError, match="has token id 80 >= vocab size 64"):
        source.samples(np.array([1]))
    streamed = open_(config(kind="arrow", path=str(path), streaming=True))
    assert isinstance(streamed, TokenStream)
    with pytest.raises(DataError, match="has token id 80 >= vocab size 64"):
        streamed.rows(0, 2)
    with pytest.raises(DataError, match="has token id 6 >= vocab size 2"):
        open_source(config(kind="arrow", path=str(path)), seed=0, vocab_size=2,
                    seq_len=SEQ_LEN).samples(np.array([0]))  # type: ignore[union-attr]


def test_unreadable_data_sets_say_what_is_wrong(tmp_path: Path) -> None:
    path = save_tokens(tmp_path / "d", DOCUMENTS)
    with pytest.raises(DataError, match=r"no column 'ids' .*input_ids"):
        open_(config(kind="arrow", path=str(path), column="ids"))
    with pytest.raises(DataError, match="no such directory"):
        open_(config(kind="arrow", path=str(tmp_path / "missing")))
    with pytest.raises(DataError, match="fewer than one sample"):
        open_(config(kind="arrow", path=str(save_tokens(tmp_path / "short", [[2, 3], [4]]))))
    text = save_text(tmp_path / "t", DOCUMENTS)
    with pytest.raises(DataError, match="expected a column of token id lists"):
        open_(config(kind="arrow", path=str(text), column="text"))
    with pytest.raises(DataError, match=r"data\.tokenizer: no such file"):
        open_(config(kind="text", path=str(text), tokenizer=str(tmp_path)))
    bare = Tokenizer(models.WordLevel({"w2": 0, "<unk>": 1}, unk_token="<unk>"))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(DataError, match=r"data\.eos_id: the tokenizer .* has none"):
        open_(config(kind="text", path=str(text), tokenizer=str(tmp_path / "bare.json")))


# ---- every kind: rank split, resume ---------------------------------------------------------


KINDS = ["synthetic", "tokens", "arrow", "text", "arrow-streaming", "text-streaming"]


def data_config(kind: str, tmp_path: Path) -> DataConfig:
    documents = random_documents(seed=2)
    streaming = kind.endswith("-streaming")
    kind = kind.removesuffix("-streaming")
    if kind == "synthetic":
        return config(num_samples=40)
    if kind == "tokens":
        path = tmp_path / "t.bin"
        np.asarray([t for d in documents for t in d], dtype=np.uint16).tofile(path)
        return config(kind="tokens", path=str(path))
    if kind == "arrow":
        return config(kind="arrow", path=str(save_tokens(tmp_path / "a", documents, 3)),
                      eos_id=EOS, streaming=streaming, shuffle_block=5)
    return config(kind="text", path=str(save_text(tmp_path / "x", documents, 3)),
                  tokenizer=str(write_tokenizer(tmp_path / "tokenizer.json")),
                  streaming=streaming, shuffle_block=5)


def global_rows(data: DataConfig, world_size: int, consumed: int) -> np.ndarray:
    readers = [BatchReader(open_(data), seed=3, global_batch=8, rank=r, world_size=world_size)
               for r in range(world_size)]
    return np.concatenate([reader.rank_batch(consumed) for reader in readers])


@pytest.mark.parametrize("kind", KINDS)
def test_the_global_batch_is_the_same_rows_in_the_same_order_at_any_world_size(
        kind: str, tmp_path: Path) -> None:
    data = data_config(kind, tmp_path)
    for consumed in (0, 8, 48, 200):  # 200 is past the first epoch of every kind
        one = global_rows(data, 1, consumed)
        assert one.shape == (8, SEQ_LEN + 1)
        np.testing.assert_array_equal(global_rows(data, 2, consumed), one)
        np.testing.assert_array_equal(global_rows(data, 4, consumed), one)
    assert not np.array_equal(global_rows(data, 1, 0), global_rows(data, 1, 8))


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_reader_at_consumed_k_sees_what_an_uninterrupted_one_saw(
        kind: str, tmp_path: Path) -> None:
    data = data_config(kind, tmp_path)
    uninterrupted = BatchReader(open_(data), seed=3, global_batch=8, rank=1, world_size=2)
    seen = [uninterrupted.rank_batch(step * 8) for step in range(40)]  # several epochs
    for step in (3, 17, 31):
        resumed = BatchReader(open_(data), seed=3, global_batch=8, rank=1, world_size=2)
        for later in range(step, step + 5):
            np.testing.assert_array_equal(resumed.rank_batch(later * 8), seen[later])
    # Going back (a restart from an older checkpoint in the same process) is the same too.
    np.testing.assert_array_equal(uninterrupted.rank_batch(0), seen[0])


def test_text_is_tokenized_into_the_same_samples_as_its_token_ids(tmp_path: Path) -> None:
    documents = random_documents(seed=4)
    tokenizer = str(write_tokenizer(tmp_path / "tokenizer.json"))
    text = open_(config(kind="text", path=str(save_text(tmp_path / "x", documents)),
                        tokenizer=tokenizer))  # EOS: the tokenizer's </s>
    ids = open_(config(kind="arrow", path=str(save_tokens(tmp_path / "a", documents)),
                       eos_id=EOS))
    np.testing.assert_array_equal(all_rows(text), all_rows(ids))


# ---- streaming ----------------------------------------------------------------------------


def test_a_streamed_epoch_is_the_indexed_samples_shuffled_block_by_block(tmp_path: Path) -> None:
    path = str(save_tokens(tmp_path / "d", random_documents(seed=5, count=120), 3))
    indexed = all_rows(open_(config(kind="arrow", path=path, eos_id=EOS)))
    stream = open_(config(kind="arrow", path=path, eos_id=EOS, streaming=True, shuffle_block=8))
    assert isinstance(stream, TokenStream)
    total = len(indexed)
    epoch0, epoch1 = stream.rows(0, total), stream.rows(total, total)
    for epoch in (epoch0, epoch1):
        for first in range(0, total, 8):  # each block holds the same samples, reordered
            block = epoch[first:first + 8]
            expected = indexed[first:first + 8]
            assert sorted(map(tuple, block)) == sorted(map(tuple, expected))
    assert not np.array_equal(epoch0, indexed)
    assert not np.array_equal(epoch0, epoch1)  # each epoch shuffles its blocks anew
    reseeded = open_(config(kind="arrow", path=path, eos_id=EOS, streaming=True, shuffle_block=8),
                     seed=4)
    assert not np.array_equal(reseeded.rows(0, total), epoch0)  # type: ignore[union-attr]


def test_a_streamed_reader_starting_late_matches_one_that_read_from_zero(tmp_path: Path) -> None:
    path = str(save_tokens(tmp_path / "d", random_documents(seed=6, count=90), 4))
    data = config(kind="arrow", path=path, streaming=True, shuffle_block=6)
    from_zero = open_(data)
    whole = np.concatenate([from_zero.rows(p, 7) for p in range(0, 280, 7)])  # type: ignore[union-attr]
    for k in (0, 5, 6, 61, 150, 273):
        fresh = open_(data)
        np.testing.assert_array_equal(fresh.rows(k, 7), whole[k:k + 7])  # type: ignore[union-attr]


def test_a_streamed_rank_batch_has_no_sample_indices(tmp_path: Path) -> None:
    data = config(kind="arrow", path=str(save_tokens(tmp_path / "d", DOCUMENTS)), streaming=True)
    reader = BatchReader(open_(data), seed=3, global_batch=2, rank=0, world_size=1)
    assert reader.rank_batch(0).shape == (2, SEQ_LEN + 1)
    with pytest.raises(TypeError):
        reader.rank_indices(0)


# ---- validation data ----------------------------------------------------------------------


def test_validation_fraction_holds_out_the_last_samples(tmp_path: Path) -> None:
    path = str(save_tokens(tmp_path / "d", random_documents(seed=7), 2))
    whole = all_rows(open_(config(kind="arrow", path=path)))
    data = config(kind="arrow", path=path, validation_fraction=0.25)
    train = all_rows(open_(data))
    validation = open_validation_source(data, seed=3, vocab_size=VOCAB, seq_len=SEQ_LEN)
    assert validation is not None
    held = len(whole) // 4
    assert validation.num_samples == held and len(train) == len(whole) - held
    np.testing.assert_array_equal(train, whole[:-held])
    np.testing.assert_array_equal(validation.samples(np.arange(held)), whole[-held:])
    assert open_validation_source(config(kind="arrow", path=path), seed=3, vocab_size=VOCAB,
                                  seq_len=SEQ_LEN) is None
    with pytest.raises(DataError, match="leaves none to train on"):
        open_(config(kind="arrow", path=str(save_tokens(tmp_path / "s", [[2, 3, 4, 5, 6]], 1)),
                     validation_fraction=0.5))


def test_the_validation_split_reuses_the_opened_training_set(tmp_path: Path) -> None:
    data = config(kind="arrow", path=str(save_tokens(tmp_path / "d", random_documents(seed=7), 2)),
                  validation_fraction=0.25)
    training = open_(data)
    shared = open_validation_source(data, seed=3, vocab_size=VOCAB, seq_len=SEQ_LEN, training=training)
    own = open_validation_source(data, seed=3, vocab_size=VOCAB, seq_len=SEQ_LEN)
    assert isinstance(training, SampleRange) and isinstance(shared, SampleRange) and own is not None
    assert shared.source is training.source  # opened once
    np.testing.assert_array_equal(shared.samples(np.arange(shared.num_samples)),
                                  own.samples(np.arange(own.num_samples)))


def test_validation_path_is_a_second_set_of_the_same_kind(tmp_path: Path) -> None:
    held_out = save_tokens(tmp_path / "v", DOCUMENTS)
    data = config(kind="arrow", path=str(save_tokens(tmp_path / "d", random_documents(8))),
                  validation_path=str(held_out), streaming=True)
    validation = open_validation_source(data, seed=3, vocab_size=VOCAB, seq_len=SEQ_LEN)
    assert validation is not None
    np.testing.assert_array_equal(validation.samples(np.arange(validation.num_samples)),
                                  all_rows(open_(config(kind="arrow", path=str(held_out)))))


# ---- configuration ------------------------------------------------------------------------


def errors_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"data": data})
    return caught.value.errors


def test_document_kinds_need_their_keys_and_refuse_the_others() -> None:
    assert errors_of({"kind": "text", "path": "x"}) == ["data.tokenizer: required when kind = 'text'"]
    assert errors_of({"kind": "arrow"}) == ["data.path: required when kind = 'arrow'"]
    assert errors_of({"kind": "parquet", "path": "x"}) == [
        "data.kind: expected one of 'synthetic', 'tokens', 'arrow', 'text', got 'parquet'"]
    assert errors_of({"tokenizer": "t.json", "column": "ids", "eos_id": 2, "streaming": True}) == [
        "data.tokenizer: only used when kind is 'text'",
        "data.column: only used when kind is 'arrow' or 'text'",
        "data.eos_id: only used when kind is 'arrow' or 'text'",
        "data.streaming: only possible when kind is 'arrow' or 'text'",
    ]
    assert errors_of({"kind": "tokens", "path": "t.bin", "tokenizer": "t.json"}) == [
        "data.tokenizer: only used when kind is 'text'"]


def test_document_keys_are_type_and_range_checked() -> None:
    assert errors_of({"kind": "arrow", "path": "", "column": "", "eos_id": -1, "streaming": "yes",
                      "shuffle_block": 0, "validation_fraction": 1.0}) == [
        "data.path: expected a path, got ''",
        "data.column: expected a column name, got ''",
        "data.eos_id: expected an integer >= 0, got -1",
        "data.streaming: expected true or false, got 'yes'",
        "data.shuffle_block: expected a positive integer, got 0",
        "data.validation_fraction: expected a number < 1.0, got 1",
    ]
    assert errors_of({"kind": "arrow", "path": "d", "validation_path": "v",
                      "validation_fraction": 0.1}) == [
        "data.validation_fraction: set validation_path or validation_fraction, not both"]
    assert errors_of({"kind": "arrow", "path": "d", "streaming": True,
                      "validation_fraction": 0.1}) == [
        "data.validation_fraction: not possible with streaming (the set's size is unknown); "
        "use validation_path"]
    assert errors_of({"validation_path": "v"}) == [
        "data.validation_path: only used when kind is 'tokens' or 'arrow' or 'text'"]


def test_the_document_column_defaults_by_kind() -> None:
    assert config(kind="arrow", path="d").document_column() == "input_ids"
    assert config(kind="text", path="d", tokenizer="t").document_column() == "text"
    assert config(kind="text", path="d", tokenizer="t", column="body").document_column() == "body"
    loaded = config_from_dict({"data": {"kind": "arrow", "path": "d", "eos_id": 2,
                                        "validation_fraction": 0}}).data
    assert loaded.eos_id == 2 and loaded.validation_fraction == 0.0
