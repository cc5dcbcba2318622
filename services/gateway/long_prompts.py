"""Long text prompts tokenized in pieces at once, with the same token ids as one call.

A prompt's tokenization is most of the gateway's own time (arrival to publish): an 8192-token
prompt took 12-13 ms on one core of the CPU box, and on the H200 host the gateway part was
31 ms at c=1. vLLM's renderer (and so ``vllm serve``) tokenizes a prompt in one call on one
thread. ``PieceTokenizer`` cuts a long text where a byte-level BPE's pre-tokenizer must cut
anyway, before a space that starts a word (`` ?\\p{L}+`` in GPT-2's and Llama 3's split
patterns: no pre-token spans such a boundary, and BPE merges never cross a pre-token), and
encodes the pieces with the Rust tokenizer's ``encode_batch``, which runs them on its own
threads; the ids are the pieces' ids joined, between the special tokens the tokenizer adds.

It is used only where that is provably the same: a fast tokenizer with no normalizer (or NFC),
a byte-level pre-tokenizer splitting by such a pattern, added tokens that neither hold nor strip
whitespace, and a check at start that encodes texts made to stress the boundaries (the added
tokens among them) both ways. ``install`` puts it in front of the renderer's
tokenization for text prompts of ``MIN_CHARS`` or more that ask for no character offsets and
no truncation that would apply; everything else takes vLLM's own path.

Threading model: ``PieceTokenizer`` holds no mutable state after ``__init__`` (a private copy
of the Rust tokenizer, truncation and padding off); ``encode`` runs on vLLM's renderer threads.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Final

log = logging.getLogger(__name__)

MIN_CHARS: Final = 16384  # shorter texts (about 4k tokens): one call costs about as much
PIECE_CHARS: Final = 2048  # a piece's length before its cut
WORD_START: Final = re.compile(r"(?<=\S)(?= [A-Za-z])")  # before " word", after a non-space
LETTER_WORD: Final = r"?\p{L}+"  # in the split pattern: an optional char, then letters


def _probe_texts() -> list[str]:
    """Texts that put every kind of neighbour on both sides of a cut (about 10k characters)."""
    words = [
        "the", "Tokenizer", "naïve", "café", "x", "I'll", "don't", "(word)", "3.14", "1000000",
        "end.", "--flag", "a_b", "#tag", "ẞtraße", "日本語", "😀", "\t", "\n", "  ", "'s",
    ]  # fmt: skip
    texts = [" ".join(words[shift:] + words[:shift]) * 3 for shift in range(len(words))]
    return [*texts, "word " * 300 + "end", " leading space, then words" * 40]


class PieceTokenizer:
    """A fast tokenizer's ids for a long text, from pieces encoded at once (module docstring)."""

    def __init__(self, backend: Any) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(backend.to_str())
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        probe = "a"
        bare = self._tokenizer.encode(probe, add_special_tokens=False).ids
        full = self._tokenizer.encode(probe, add_special_tokens=True).ids
        at = next(i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare)
        self._prefix, self._suffix = full[:at], full[at + len(bare) :]

    @classmethod
    def of(cls, tokenizer: Any) -> PieceTokenizer | None:
        """One for ``tokenizer`` (a transformers fast tokenizer), or None where cutting a text
        could change its ids."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            return None
        spec = json.loads(backend.to_str())
        normalizer = spec.get("normalizer")
        if normalizer not in (None, {"type": "NFC"}):  # NFC joins nothing across a space
            return None
        if not _splits_before_words(spec["pre_tokenizer"]) or not _plain_added(tokenizer, backend):
            return None
        try:
            pieces = cls(backend)
        except StopIteration:  # the special tokens do not wrap the text: no way to place them
            return None
        added = [token.content for token in backend.get_added_tokens_decoder().values()]
        for text in [*_probe_texts(), " word ".join(["Say", *added[:64], "end"]) * 8]:
            for special in (True, False):  # against the call vLLM makes
                whole = list(tokenizer(text, add_special_tokens=special)["input_ids"])
                if pieces.encode(text, special, piece_chars=64) != whole:
                    log.info("long prompts are tokenized in one call: pieces differ")
                    return None
        return pieces

    def encode(
        self, text: str, add_special_tokens: bool, piece_chars: int = PIECE_CHARS
    ) -> list[int]:
        cuts = [0]
        while (found := WORD_START.search(text, cuts[-1] + piece_chars)) is not None:
            cuts.append(found.start())
        pieces = [text[a:b] for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True)]
        ids = [
            i for e in self._tokenizer.encode_batch(pieces, add_special_tokens=False) for i in e.ids
        ]
        return [*self._prefix, *ids, *self._suffix] if add_special_tokens else ids


def _plain_added(tokenizer: Any, backend: Any) -> bool:
    """No added token that a cut could split or whose neighbour a cut could change: none with
    whitespace in it or stripping it (lstrip, rstrip), none single-word, and special tokens
    not encoded as text (``split_special_tokens``)."""
    if getattr(tokenizer, "split_special_tokens", False):
        return False
    for token in backend.get_added_tokens_decoder().values():
        if (
            token.lstrip
            or token.rstrip
            or token.single_word
            or any(c.isspace() for c in token.content)
        ):
            return False
    return True


def _splits_before_words(pre: dict[str, Any] | None) -> bool:
    """Is ``pre`` a byte-level pre-tokenizer whose split pattern starts a pre-token at an
    optional char followed by letters (GPT-2: ByteLevel with its regex; Llama 3 / Qwen: a
    Split by such a pattern, then ByteLevel without one)?"""
    if pre is None:
        return False
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True))
    if pre.get("type") != "Sequence":
        return False
    steps = pre.get("pretokenizers", [])
    kinds = [step.get("type") for step in steps]
    if kinds != ["Split", "ByteLevel"] or steps[1].get("use_regex"):
        return False
    split = steps[0]
    pattern = split.get("pattern", {}).get("Regex", "")
    return (
        LETTER_WORD in pattern and split.get("behavior") == "Isolated" and not split.get("invert")
    )


def install(renderer: Any) -> bool:
    """Tokenize the renderer's long text prompts in pieces (where ``PieceTokenizer.of`` allows);
    True if installed."""
    from vllm.utils.async_utils import make_async

    needed = ("_tokenize_prompt", "_wants_offsets", "_build_tokens_prompt", "_executor")
    if getattr(renderer, "tokenizer", None) is None or not all(
        hasattr(renderer, name) for name in needed
    ):
        return False
    pieces = PieceTokenizer.of(renderer.tokenizer)
    if pieces is None:
        return False
    whole = renderer._tokenize_prompt

    def tokenize(prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt")
        if not isinstance(text, str) or len(text) < MIN_CHARS:  # most prompts: vLLM's call
            return whole(prompt, params)
        kwargs = params.get_encode_kwargs()
        plain = set(kwargs) <= {"truncation", "max_length", "add_special_tokens"}
        if not plain or renderer._wants_offsets(prompt, params):
            return whole(prompt, params)
        ids = pieces.encode(text, kwargs.get("add_special_tokens", True))
        limit = kwargs.get("max_length") if kwargs.get("truncation") else None
        if limit is not None and len(ids) > limit:  # truncated: vLLM's own call decides
            return whole(prompt, params)
        return renderer._build_tokens_prompt(ids, prompt)

    renderer._tokenize_prompt = tokenize
    renderer._tokenize_prompt_async = make_async(tokenize, executor=renderer._executor)
    return True
