"""Training samples packed from document data sets saved with Hugging Face ``datasets``.

A document data set is rows of one column: token ids (``data.kind = "arrow"``, a list
column such as ``input_ids``) or raw text (``"text"``, tokenized here with a
``tokenizer.json`` from a local path). It is a directory written by
``Dataset.save_to_disk`` (arrow shards and ``state.json``) or a directory of ``*.arrow``
files, read in file-name order.

Packing reads the documents in storage order as one token stream, with ``eos_id`` after
every non-empty document when there is one (an empty document adds nothing, not even an
EOS), and cuts the stream into samples of ``seq_len + 1`` tokens: sample ``i`` is stream
tokens ``[i * seq_len, i * seq_len + seq_len + 1)``. Consecutive samples share one token,
as trainer.data.TokenFile's do, so every token after the first is a target exactly once
and none is thrown away at a sample boundary; the tail shorter than a sample is left out.
Samples run across document boundaries (the model sees the EOS between them).

Two ways to read the packed samples:

``PackedTokens`` (indexed) knows every document's length when it opens, so it can read
any sample directly, which trainer.data's epoch-wise permutation needs. For token ids the
lengths come from the list column's offsets (a cumulative sum per arrow chunk; no token
is read), and a sample is a slice of the memory-mapped values. Raw text has no lengths
before it is tokenized, so the indexed text source tokenizes every document when it
opens (in arrow-chunk blocks, all at once in the tokenizer's Rust threads) and keeps the
ids in memory: "on the fly" means at every trainer start, with no preprocessing step and
no cache file that several ranks would have to agree on.

``StreamedTokens`` (``data.streaming = true``) never indexes the whole set: it reads the
documents in order, one arrow chunk at a time, packs them as above and shuffles each
consecutive block of ``shuffle_block`` packed samples with a permutation seeded by
(seed, epoch, block). An epoch is one pass over the data; its length is learnt when the
first pass reaches the end. Stream position ``p`` (samples consumed) therefore names the
same sample whatever was read before: a reader that starts at ``p`` re-reads the data
from its start and skips to the block holding ``p``. Skipping costs the document lengths
only for token ids (the offsets of the skipped chunks; their tokens are not paged in) and
a full tokenization of every skipped document for raw text.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from wire.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa
    import tokenizers

Int64Array = npt.NDArray[np.int64]

# trainer.data uses spawn keys 1 and 2 of the same SeedSequence scheme.
_STREAM_BLOCKS = 3

# End-of-text tokens of common tokenizers, looked up when data.eos_id is not set.
_EOS_TOKENS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


class DocumentChunk:
    """Consecutive documents: document ``k`` is ``values[offsets[k]:offsets[k + 1]]``.

    Its packed token stream is the documents in order, each non-empty one followed by
    ``eos_id`` when that is set.
    """

    def __init__(self, offsets: Int64Array, values: npt.NDArray[np.integer[Any]],
                 eos_id: int | None) -> None:
        self._offsets, self._values, self._eos_id = offsets, values, eos_id
        self._lengths = np.diff(offsets)
        self._sizes = self._lengths + (self._lengths > 0) if eos_id is not None else self._lengths
        self._ends = np.cumsum(self._sizes)  # where each document's part of the stream ends

    @property
    def num_tokens(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def tokens(self, start: int, stop: int) -> Int64Array:
        """Stream tokens ``[start, stop)`` of this chunk."""
        if self._eos_id is None:  # the documents' ids are contiguous in ``values``
            first = int(self._offsets[0])
            return self._values[first + start:first + stop].astype(np.int64)
        positions = np.arange(start, stop)
        document = np.searchsorted(self._ends, positions, side="right")
        within = positions - (self._ends[document] - self._sizes[document])
        is_eos = within >= self._lengths[document]
        source = np.minimum(self._offsets[document] + within, len(self._values) - 1)
        out: Int64Array = self._values[source].astype(np.int64)
        out[is_eos] = self._eos_id
        return out


def check_vocab(rows: Int64Array, vocab_size: int, where: str) -> None:
    """DataError when a token id does not fit the model's embedding table."""
    if not rows.size:
        return
    if int(rows.max()) >= vocab_size:
        raise DataError(f"{where} has token id {int(rows.max())} >= vocab size {vocab_size}")
    if int(rows.min()) < 0:
        raise DataError(f"{where} has a negative token id {int(rows.min())}")


def windows(tokens: Int64Array, seq_len: int, count: int) -> Int64Array:
    """The first ``count`` samples of a token run: row i is tokens[i*seq_len : i*seq_len+seq_len+1]."""
    index = np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    rows: Int64Array = tokens[index]
    return rows


class PackedTokens:
    """Indexed packed samples (a trainer.data.TokenSource) over chunks held in order."""

    def __init__(self, chunks: Sequence[DocumentChunk], *, seq_len: int, vocab_size: int,
                 where: str) -> None:
        counts = np.array([chunk.num_tokens for chunk in chunks], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._chunks, self._seq_len, self._vocab_size, self._where = chunks, seq_len, vocab_size, where
        total = int(self._starts[-1])
        if total < seq_len + 1:
            raise DataError(f"{where} holds {total} tokens after packing, fewer than one "
                            f"sample of seq_len + 1 = {seq_len + 1}")

    @property
    def num_samples(self) -> int:
        return (int(self._starts[-1]) - 1) // self._seq_len

    def samples(self, indices: Int64Array) -> Int64Array:
        rows = np.empty((len(indices), self._seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            start = int(index) * self._seq_len
            rows[row] = self._read(start, start + self._seq_len + 1)
        check_vocab(rows, self._vocab_size, self._where)
        return rows

    def _read(self, start: int, stop: int) -> Int64Array:
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            chunk_start, chunk_stop = int(self._starts[k]), int(self._starts[k + 1])
            take = min(stop, chunk_stop)
            pieces.append(self._chunks[k].tokens(start - chunk_start, take - chunk_start))
            start, k = take, k + 1
        return np.concatenate(pieces)


class _Cursor:
    """Reads ranges of one pass's token stream, moving forward through the chunks.

    A range that starts before the current chunk re-opens the pass from its beginning.
    ``total`` is the pass's token count once a read has reached its end.
    """

    def __init__(self, open_pass: Callable[[], Iterator[DocumentChunk]]) -> None:
        self._open_pass = open_pass
        self._chunks: Iterator[DocumentChunk] = iter(())
        self._chunk: DocumentChunk | None = None
        self._start = 0  # stream position of the current chunk's first token
        self.total: int | None = None

    def _advance(self) -> bool:
        if self._chunk is not None:
            self._start += self._chunk.num_tokens
        self._chunk = next(self._chunks, None)
        if self._chunk is None:
            self.total = self._start
        return self._chunk is not None

    def read(self, start: int, stop: int) -> Int64Array:
        """Tokens ``[start, stop)``, fewer where the pass ends first."""
        if self.total is not None and start >= self.total:
            return np.empty(0, dtype=np.int64)
        if self._chunk is None or start < self._start:
            self._chunks, self._chunk, self._start = self._open_pass(), None, 0
            if not self._advance():
                return np.empty(0, dtype=np.int64)
        pieces = [np.empty(0, dtype=np.int64)]
        position = start
        while position < stop:
            assert self._chunk is not None
            chunk_stop = self._start + self._chunk.num_tokens
            if position < chunk_stop:
                take = min(stop, chunk_stop)
                pieces.append(self._chunk.tokens(position - self._start, take - self._start))
                position = take
            # Keep the chunk that holds the last token read: the next block starts there.
            if position < stop and not self._advance():
                break
        return np.concatenate(pieces)


class StreamedTokens:
    """Packed samples in training order, read as a stream (see the module docstring).

    ``rows(start, count)`` are the samples at stream positions ``[start, start + count)``.
    """

    def __init__(self, open_pass: Callable[[], Iterator[DocumentChunk]], *, seed: int,
                 seq_len: int, vocab_size: int, shuffle_block: int, where: str) -> None:
        self._cursor = _Cursor(open_pass)
        self._seed, self._seq_len, self._vocab_size = seed, seq_len, vocab_size
        self._block_size, self._where = shuffle_block, where
        self._per_pass: int | None = None  # samples in one epoch, once known
        self._cached: tuple[tuple[int, int], Int64Array] | None = None

    def rows(self, start: int, count: int) -> Int64Array:
        out = np.empty((count, self._seq_len + 1), dtype=np.int64)
        filled = 0
        while filled < count:
            position = start + filled
            first, block = self._block_at(position)
            take = min(count - filled, first + len(block) - position)
            out[filled:filled + take] = block[position - first:position - first + take]
            filled += take
        check_vocab(out, self._vocab_size, self._where)
        return out

    def _block_at(self, position: int) -> tuple[int, Int64Array]:
        """The shuffled block holding stream position ``position``, and its first position."""
        if self._per_pass is None:  # assume epoch 0 until the pass is known to be shorter
            block = self._block(0, position // self._block_size)
            if self._per_pass is None or position < self._per_pass:
                return position - position % self._block_size, block
        assert self._per_pass is not None
        epoch, offset = divmod(position, self._per_pass)
        index = offset // self._block_size
        return epoch * self._per_pass + index * self._block_size, self._block(epoch, index)

    def _block(self, epoch: int, index: int) -> Int64Array:
        if self._cached is not None and self._cached[0] == (epoch, index):
            return self._cached[1]
        first = index * self._block_size
        tokens = self._cursor.read(first * self._seq_len,
                                   (first + self._block_size) * self._seq_len + 1)
        if self._cursor.total is not None and self._per_pass is None:
            self._per_pass = max(self._cursor.total - 1, 0) // self._seq_len
            if self._per_pass == 0:
                raise DataError(f"{self._where} holds {self._cursor.total} tokens after "
                                f"packing, fewer than one sample of seq_len + 1 = "
                                f"{self._seq_len + 1}")
        count = min(self._block_size, max(len(tokens) - 1, 0) // self._seq_len)
        rng = np.random.default_rng(np.random.SeedSequence([self._seed, _STREAM_BLOCKS,
                                                            epoch, index]))
        block = windows(tokens, self._seq_len, count)[rng.permutation(count)]
        self._cached = ((epoch, index), block)
        return block


# ---- reading data sets from disk (datasets, pyarrow and tokenizers imported lazily) -------


def _shard_files(path: Path, where: str) -> list[Path]:
    """The arrow files of a data set directory, in order."""
    if not path.is_dir():
        raise DataError(f"{where}: no such directory: {path}")
    if (path / "dataset_dict.json").is_file():
        splits = ", ".join(sorted(p.name for p in path.iterdir() if p.is_dir()))
        raise DataError(f"{where}: {path} holds several splits ({splits}); name one split's "
                        f"directory")
    state = path / "state.json"
    if state.is_file():
        files = [path / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    else:
        files = sorted(path.glob("*.arrow"))
    if not files:
        raise DataError(f"{where}: {path} has no arrow files (expected a directory written "
                        f"by Dataset.save_to_disk, or *.arrow files)")
    return files


def _load_column(path: Path, column: str, where: str) -> list[pa.Array]:
    """Every arrow chunk of ``column``, memory-mapped, for the indexed sources."""
    import datasets

    files = _shard_files(path, where)
    if (path / "state.json").is_file():
        dataset = datasets.load_from_disk(str(path))
    else:
        dataset = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files])
    return _column_chunks(dataset.data, column, where)


def _stream_column(path: Path, column: str, where: str) -> Iterator[pa.Array]:
    """The arrow chunks of ``column``, one shard memory-mapped at a time."""
    import datasets

    for file in _shard_files(path, where):
        yield from _column_chunks(datasets.Dataset.from_file(str(file)).data, column, where)


def _column_chunks(table: Any, column: str, where: str) -> list[pa.Array]:
    if column not in table.column_names:
        raise DataError(f"{where}: no column {column!r} (data.column); the data set has "
                        f"{', '.join(table.column_names)}")
    chunks: list[pa.Array] = table.column(column).chunks
    return chunks


def _token_chunk(array: pa.Array, eos_id: int | None, where: str) -> DocumentChunk:
    import pyarrow as pa

    kind = array.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or \
            not pa.types.is_integer(kind.value_type):
        raise DataError(f"{where}: expected a column of token id lists, got {kind}")
    if array.null_count or array.values.null_count:
        raise DataError(f"{where}: the token id column has missing values")
    offsets = array.offsets.to_numpy().astype(np.int64)
    return DocumentChunk(offsets, array.values.to_numpy(zero_copy_only=True), eos_id)


def load_tokenizer(path: Path) -> tokenizers.Tokenizer:
    """A tokenizer from a ``tokenizer.json`` file or a directory holding one."""
    import tokenizers

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"data.tokenizer: no such file: {file}")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises plain Exception for a bad file
        raise DataError(f"data.tokenizer: cannot load {file}: {e}") from e


def tokenizer_eos(tokenizer: tokenizers.Tokenizer, file: Path) -> int:
    """The id of the tokenizer's end-of-text token."""
    for token in _EOS_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    raise DataError(f"data.eos_id: the tokenizer {file} has none of the end-of-text tokens "
                    f"{', '.join(_EOS_TOKENS)}; set data.eos_id")


def _text_chunk(array: pa.Array, tokenizer: tokenizers.Tokenizer, eos_id: int,
                where: str) -> DocumentChunk:
    import pyarrow as pa

    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        raise DataError(f"{where}: expected a column of text, got {array.type}")
    texts = [text or "" for text in array.to_pylist()]
    ids = [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int64)
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1]))
    return DocumentChunk(offsets, values, eos_id)


def _chunk_maker(*, kind: str, tokenizer: Path | None, eos_id: int | None,
                 where: str) -> Callable[[pa.Array], DocumentChunk]:
    if kind == "arrow":
        return lambda array: _token_chunk(array, eos_id, where)
    assert tokenizer is not None  # DataConfig requires data.tokenizer for kind = "text"
    loaded = load_tokenizer(tokenizer)
    text_eos = eos_id if eos_id is not None else tokenizer_eos(loaded, tokenizer)
    return lambda array: _text_chunk(array, loaded, text_eos, where)


def open_packed(path: Path, *, kind: str, column: str, tokenizer: Path | None,
                eos_id: int | None, seq_len: int, vocab_size: int) -> PackedTokens:
    """The indexed packed samples of a data set directory (kind "arrow" or "text")."""
    where = f"data set {path}"
    make = _chunk_maker(kind=kind, tokenizer=tokenizer, eos_id=eos_id, where=where)
    chunks = [make(array) for array in _load_column(path, column, where)]
    return PackedTokens(chunks, seq_len=seq_len, vocab_size=vocab_size, where=where)


def open_streamed(path: Path, *, kind: str, column: str, tokenizer: Path | None,
                  eos_id: int | None, seed: int, seq_len: int, vocab_size: int,
                  shuffle_block: int) -> StreamedTokens:
    """The packed samples of a data set directory as a seeded stream (kind "arrow" or "text")."""
    where = f"data set {path}"
    make = _chunk_maker(kind=kind, tokenizer=tokenizer, eos_id=eos_id, where=where)
    _shard_files(path, where)  # a missing or empty directory fails now, not at the first step

    def open_pass() -> Iterator[DocumentChunk]:
        return (make(array) for array in _stream_column(path, column, where))

    return StreamedTokens(open_pass, seed=seed, seq_len=seq_len, vocab_size=vocab_size,
                          shuffle_block=shuffle_block, where=where)
