"""trainer.corpus: the tiny corpus, its tokenizer, and reading it as kind "text" and "arrow"."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer

from trainer.config import config_from_dict
from trainer.corpus import TinyCorpus, main, tiny_documents, write_tiny_corpus
from trainer.data import TokenStream, open_source
from trainer.shapes import SHAPES


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TinyCorpus:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"), seed=5)


def test_the_corpus_fits_the_tiny_model(corpus: TinyCorpus) -> None:
    written = corpus
    assert written.documents == 4000 and written.token_count > 50_000
    assert written.vocab_size <= SHAPES["tiny"].vocab_size
    ids = datasets.load_from_disk(str(written.tokens))["input_ids"]
    assert len(ids) == 4000 and sum(len(i) for i in ids) == written.token_count
    assert max(max(i) for i in ids) < written.vocab_size
    assert all(i[-1] == written.eos_id for i in ids)  # every document ends with EOS, as the seeds'
    assert len(list(written.tokens.glob("*.arrow"))) == 4 == len(list(written.text.glob("*.arrow")))


def test_the_tokenizer_round_trips_the_text(corpus: TinyCorpus) -> None:
    written = corpus
    tokenizer = Tokenizer.from_file(str(written.tokenizer))
    texts = datasets.load_from_disk(str(written.text))["text"]
    for text in texts[:50]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text


def test_the_corpus_is_learnable(corpus: TinyCorpus) -> None:
    """The next token given the previous one is far from uniform: the loss can fall a lot."""
    written = corpus
    ids = datasets.load_from_disk(str(written.tokens))["input_ids"]
    pairs = Counter((a, b) for document in ids for a, b in itertools.pairwise(document))
    firsts = Counter[int]()
    for (a, _), n in pairs.items():
        firsts[a] += n
    total = sum(pairs.values())
    entropy = -sum(n / total * np.log(n / firsts[a]) for (a, _), n in pairs.items())
    assert entropy < 0.5 * np.log(written.vocab_size)


def test_the_same_seed_writes_the_same_corpus(corpus: TinyCorpus, tmp_path: Path) -> None:
    written = corpus
    again = write_tiny_corpus(tmp_path / "again", seed=5, documents=4000)
    assert again.tokenizer.read_bytes() == written.tokenizer.read_bytes()
    assert again.token_count == written.token_count
    assert (datasets.load_from_disk(str(again.tokens))["input_ids"]
            == datasets.load_from_disk(str(written.tokens))["input_ids"])
    assert tiny_documents(30, seed=5) == tiny_documents(30, seed=5) != tiny_documents(30, seed=6)


def test_text_tokenized_on_the_fly_equals_the_pre_tokenized_set(corpus: TinyCorpus) -> None:
    written = corpus
    shape = SHAPES["tiny"]
    text = open_source(config_from_dict({"data": {
        "kind": "text", "path": str(written.text), "tokenizer": str(written.tokenizer.parent)}}).data,
        seed=1, vocab_size=shape.vocab_size, seq_len=shape.max_seq_len)
    tokens = open_source(config_from_dict({"data": {"kind": "arrow", "path": str(written.tokens)}}).data,
                         seed=1, vocab_size=shape.vocab_size, seq_len=shape.max_seq_len)
    assert not isinstance(text, TokenStream) and not isinstance(tokens, TokenStream)
    assert text.num_samples == tokens.num_samples == (written.token_count - 1) // shape.max_seq_len
    everything = np.arange(tokens.num_samples)
    np.testing.assert_array_equal(text.samples(everything), tokens.samples(everything))
    streamed = open_source(config_from_dict({"data": {
        "kind": "text", "path": str(written.text), "tokenizer": str(written.tokenizer),
        "streaming": True, "shuffle_block": 64}}).data,
        seed=1, vocab_size=shape.vocab_size, seq_len=shape.max_seq_len)
    assert isinstance(streamed, TokenStream)
    first_block = streamed.rows(0, 64)
    assert sorted(map(tuple, first_block)) == sorted(map(tuple, tokens.samples(np.arange(64))))


def test_the_command_line_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "c"), "--seed", "2", "--documents", "300"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 300 and summary["vocab_size"] <= 256
    assert Path(summary["tokenizer"]).is_file() and Path(summary["tokens"]).is_dir()
