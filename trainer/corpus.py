"""A tiny English-like corpus, its tokenizer and both data set forms, written from a seed.

Tests and demos need real documents (not the synthetic Markov chain) without a download.
``write_tiny_corpus(DIR)`` (or ``python -m trainer.corpus DIR``) writes into DIR:

    tokenizer.json   a byte-level BPE tokenizer trained on the corpus, vocabulary <= 256
                     (the ``tiny`` model's), with ``<|end_of_text|>`` as its EOS token
    text/            the raw documents: a data set with a ``text`` column (kind "text")
    tokens/          the same documents tokenized, each followed by EOS, in an
                     ``input_ids`` column (kind "arrow", no data.eos_id needed)

both data sets saved with ``Dataset.save_to_disk`` in several shards. The documents come
from a small grammar: each is about one person and one animal, and the animal's sound,
food and home are fixed, so a small model can learn a lot of it (the loss falls far below
ln(vocab)). The same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

EOS_TOKEN = "<|end_of_text|>"  # noqa: S105 (a token of the vocabulary, not a password)

_NAMES = ("anna", "ben", "clara", "david", "emma", "felix", "grace", "henry", "ida", "jack",
          "lena", "max", "nora", "oscar", "paula", "sam")
_COLORS = ("red", "brown", "black", "white", "grey", "small", "big", "old", "young")
# animal: (sound, food, home)
_ANIMALS = {
    "dog": ("barks", "meat", "garden"),
    "cat": ("meows", "fish", "kitchen"),
    "cow": ("moos", "grass", "field"),
    "duck": ("quacks", "bread", "pond"),
    "horse": ("neighs", "hay", "stable"),
    "sheep": ("bleats", "grass", "meadow"),
    "pig": ("grunts", "apples", "barn"),
    "owl": ("hoots", "mice", "tree"),
}
_PLACES = ("park", "market", "river", "school", "village", "forest", "town", "lake")
_TIMES = ("in the morning", "at noon", "in the evening", "at night", "every day", "on sunday")
_FEELINGS = ("happy", "tired", "hungry", "sleepy", "glad", "calm")


@dataclass(frozen=True)
class TinyCorpus:
    """What write_tiny_corpus wrote, and how big it is."""

    tokenizer: Path  # tokenizer.json
    text: Path  # data set directory, column "text"
    tokens: Path  # data set directory, column "input_ids" (documents end with EOS)
    eos_id: int
    vocab_size: int  # the tokenizer's; every id in tokens/ is below it
    documents: int
    token_count: int  # ids in tokens/, EOS included


def _document(rng: random.Random) -> str:
    name, color = rng.choice(_NAMES), rng.choice(_COLORS)
    animal = rng.choice(sorted(_ANIMALS))
    sound, food, home = _ANIMALS[animal]
    templates = (
        f"the {animal} {sound} {rng.choice(_TIMES)}.",
        f"the {animal} eats {food}.",
        f"the {animal} sleeps in the {home}.",
        f"{name} goes to the {rng.choice(_PLACES)} with the {animal}.",
        f"{name} is {rng.choice(_FEELINGS)} and the {animal} is {rng.choice(_FEELINGS)}.",
        f"{name} gives {food} to the {color} {animal}.",
    )
    sentences = [f"{name} has a {color} {animal}."]
    sentences += [rng.choice(templates) for _ in range(rng.randint(1, 6))]
    return " ".join(sentences)


def tiny_documents(count: int, seed: int) -> list[str]:
    """``count`` documents of the grammar, the same for the same seed."""
    rng = random.Random(seed)
    return [_document(rng) for _ in range(count)]


def write_tiny_corpus(directory: str | Path, *, seed: int = 0, documents: int = 4000,
                      vocab_size: int = 256, num_shards: int = 4) -> TinyCorpus:
    """Write the corpus, its tokenizer and both data sets into ``directory`` (see above)."""
    import datasets
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    texts = tiny_documents(documents, seed)

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # No initial alphabet: only the bytes the corpus uses, so that merges fit in 256 ids.
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False))
    tokenizer_file = root / "tokenizer.json"
    tokenizer.save(str(tokenizer_file))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    assert eos_id is not None  # a special token of the trainer above

    ids = [[*encoding.ids, eos_id]
           for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(
            str(root / "text"), num_shards=num_shards)
        token_features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
        datasets.Dataset.from_dict({"input_ids": ids}, features=token_features).save_to_disk(
            str(root / "tokens"), num_shards=num_shards)
    finally:
        if bars:
            datasets.enable_progress_bars()
    return TinyCorpus(tokenizer=tokenizer_file, text=root / "text", tokens=root / "tokens",
                      eos_id=eos_id, vocab_size=tokenizer.get_vocab_size(),
                      documents=len(texts), token_count=sum(len(i) for i in ids))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("directory", help="where to write tokenizer.json, text/ and tokens/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", type=int, default=4000)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    corpus = write_tiny_corpus(args.directory, seed=args.seed, documents=args.documents)
    summary = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(corpus).items()}
    summary["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
