"""The tokenizer of kvpush's local models: special tokens, chat template, training, files.

Owns the byte-level BPE tokenizer every built model (models.py) carries: its special tokens
and chat template, the deterministic made-up prose it is trained on (``prose_lines``, which
benchmark prompts reuse), ``train_tokenizer`` (same arguments -> same merges), ``write_tokenizer``
(the files vLLM and transformers load) and ``invisible_token_ids`` (what ``build_model`` keeps
greedy decoding from emitting).

Threading model: everything runs in the caller's thread; training is kept to one thread
(``TOKENIZERS_PARALLELISM=false``) so that it is deterministic.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
END_OF_TURN = "<|end|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (BOS, EOS, PAD, END_OF_TURN, *(f"<|{role}|>" for role in ROLES))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inline) + special_tokens_map.json."""
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    # transformers 5 writes its own class name; this one loads in transformers 4 and 5.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    specials["additional_special_tokens"] = list(tokenizer.extra_special_tokens)
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def prose_lines(seed: int, sentences: int) -> Iterator[str]:
    """Deterministic made-up prose: words from syllables, numbers, names, punctuation (the
    tokenizers are trained on it; benchmark prompts use it too)."""
    rng = random.Random(seed)
    # fmt: off
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "z", "br", "ch", "st", "th", "tr", "pl", "sh", "qu", "gr", "fl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ck", "nd", "ng", "st", "x"]
    # fmt: on

    def word() -> str:
        return "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )

    lexicon = [word() for _ in range(6000)]
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    for _ in range(sentences):
        n = rng.randint(4, 16)
        words = rng.choices(lexicon, cum_weights=cum_weights, k=n)  # Zipf-like
        for i in range(n):
            roll = rng.random()
            if roll < 0.06:
                words[i] = str(rng.randint(0, 10 ** rng.randint(1, 6)))
            elif roll < 0.10:
                words[i] = words[i].capitalize()
            elif roll < 0.12:
                words[i] = "".join(rng.choices(string.ascii_letters + string.digits, k=3))
        if rng.random() < 0.15:
            words.insert(rng.randrange(n), rng.choice(string.punctuation))
        line = " ".join(words)
        yield line[:1].upper() + line[1:] + rng.choice(".....!?:;")


def train_tokenizer(vocab_size: int, max_context: int, seed: int) -> Any:
    """Byte-level BPE trained on `prose_lines`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()  # without it decode() returns byte-level garbage
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sentences = max(20_000, vocab_size * 8)
    # one thread (no rayon pool): the same merges every time; the variable restored after
    with mock.patch.dict(os.environ, TOKENIZERS_PARALLELISM="false"):
        bpe.train_from_iterator(prose_lines(seed, sentences), trainer=trainer)
    if bpe.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer reached {bpe.get_vocab_size()} tokens, recipe wants {vocab_size}"
        )
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, EOS, PAD)],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=max_context,
        add_prefix_space=False,
    )


def invisible_token_ids(tokenizer: Any) -> list[int]:
    """Ids of special tokens and tokens that do not decode to visible printable ASCII."""
    special = set(tokenizer.all_special_ids)
    hidden = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        if token_id in special or not text.strip() or not text.isascii() or not text.isprintable():
            hidden.append(token_id)
    return hidden
