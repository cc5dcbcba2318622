"""``long_prompts.PieceTokenizer``: where cutting a text before words keeps its token ids, and
that it does keep them (small byte-level BPEs trained here, in well under a second).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvpush.services.gateway.long_prompts import PieceTokenizer

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
WORDS = [
    "the",
    "quick",
    "Brown",
    "fox's",
    "naïve",
    "café",
    "jumps",
    "42",
    "over",
    "1000",
    "lazy-dogs",
    "(again)",
    "end.",
    "x",
    "y",
    "z",
]


def texts(seed: int, count: int = 6) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = [rng.choice([*WORDS, "\n", "  ", "\t", "日本", "😀"]) for _ in range(400)]
        out.append(" ".join(parts))
    return out


def trained(kind: str) -> Any:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    if kind == "llama3":
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif kind == "metaspace":
        bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    else:
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "normalized":
        bpe.normalizer = normalizers.Lowercase()
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts(0, 20), trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_pieces_give_the_ids_of_one_call_for_byte_level_split_patterns(kind: str) -> None:
    tokenizer = trained(kind)
    pieces = PieceTokenizer.of(tokenizer)
    assert pieces is not None
    for text in texts(1):
        for special in (True, False):
            whole = tokenizer(text, add_special_tokens=special)["input_ids"]
            assert pieces.encode(text, special, piece_chars=50) == whole
    assert pieces.encode("a b", True)[0] == tokenizer.bos_token_id


@pytest.mark.parametrize("kind", ["metaspace", "normalized"])
def test_a_tokenizer_whose_ids_a_cut_could_change_gets_none(kind: str) -> None:
    assert PieceTokenizer.of(trained(kind)) is None


def test_added_tokens_that_hold_or_strip_whitespace_turn_it_off_plain_ones_keep_the_ids() -> None:
    from transformers import AddedToken

    stripping = trained("gpt2")
    stripping.add_special_tokens({"additional_special_tokens": [AddedToken("<t>", rstrip=True)]})
    spaced = trained("gpt2")
    spaced.add_tokens(["<my token>"], special_tokens=True)
    split = trained("gpt2")
    split.split_special_tokens = True
    assert PieceTokenizer.of(stripping) is PieceTokenizer.of(spaced) is PieceTokenizer.of(split)
    assert PieceTokenizer.of(split) is None
    plain = trained("gpt2")
    plain.add_tokens(["<|tool|>"], special_tokens=True)
    pieces = PieceTokenizer.of(plain)
    assert pieces is not None
    text = "hello world<|tool|> and more words " * 40
    assert pieces.encode(text, True, piece_chars=16) == plain(text)["input_ids"]
