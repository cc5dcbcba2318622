"""The multi-turn chat workload of the routing benchmark (issue 32): ``chat:N`` tables.

Conversations that share one system prompt, each turn resending the whole conversation so far,
as a chat client does. A point of ``requests`` requests is ``requests / TURNS`` conversations
(rounded up; the list is cut to ``requests``). Every conversation starts with the point's
system prompt (``SYSTEM_SHARE`` of N tokens, the same for all of them); each turn adds a user
message, and each turn but the last an assistant answer, of ``part_tokens(N)`` tokens each, so
that a conversation's last turn is about N tokens. The answers are fixed text, not what the
model answered (its weights are random: its text means nothing), so turn t reuses the previous
turn's whole prompt and adds the answer and the new message: about 88, 80, 83 and 86 % of turns
1 to 4 (turn 1: the system prompt, after the point's first conversation) is a prefix some
earlier request sent.

Requests go turn by turn (every conversation's first turn, then every second turn, ...;
``vllm bench serve --disable-shuffle``), so a turn is sent after its conversation's previous
one. The text is made-up prose (``model_tokenizer.prose_lines``, what the model's tokenizer was
trained on) in lines, each part ending with a newline (a part's tokens do not merge with
the next part's); a part's last line is cut at a word to what its length leaves, so lengths
are close to, not exactly, their targets (``vllm bench serve`` reports the lengths it sent).

``write_dataset`` writes the point's requests as ``vllm bench serve``'s custom dataset (JSONL:
``prompt`` and ``output_tokens`` per line), sent with ``--skip-chat-template`` to
``/v1/completions`` like the other tables.

Threading model: pure functions, plus the file written by ``write_dataset``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Final

from kvpush.services import model_tokenizer

TURNS: Final = 4
SYSTEM_SHARE: Final = 0.5  # of a conversation's last turn
PROSE_LINES: Final = 2000


def part_tokens(input_len: int) -> int:
    """Tokens of each user message and answer: the system prompt plus ``2 * TURNS - 1`` parts
    make the last turn ``input_len`` tokens."""
    return max(1, round(input_len * (1 - SYSTEM_SHARE) / (2 * TURNS - 1)))


def conversations(
    input_len: int, requests: int, seed: int, count_tokens: Callable[[str], int]
) -> list[str]:
    """The point's prompts in the order they are sent (see the module docstring);
    ``count_tokens`` is the model tokenizer's count of a text's tokens."""
    rng = random.Random(f"chat-{input_len}-{seed}")
    lines = [line + "\n" for line in model_tokenizer.prose_lines(seed + 104729, PROSE_LINES)]
    sizes = {line: count_tokens(line) for line in lines}

    def text(tokens: int) -> str:
        parts, total = [], 0
        while total < tokens:
            line = rng.choice(lines)
            size = sizes[line]
            if total + size > tokens:  # the last line, cut at a word to what is left
                words = line.split()
                while words and count_tokens(" ".join(words) + "\n") > tokens - total:
                    words.pop()
                if not words:
                    break
                line = " ".join(words) + "\n"
                size = count_tokens(line)
            parts.append(line)
            total += size
        return "".join(parts)

    system = "System:\n" + text(round(input_len * SYSTEM_SHARE))
    part = part_tokens(input_len)
    turns_by_conversation = []
    for _ in range(math.ceil(requests / TURNS)):
        history, turns = system, []
        for turn in range(TURNS):
            history += "User:\n" + text(part)
            turns.append(history)
            if turn < TURNS - 1:
                history += "Assistant:\n" + text(part)
        turns_by_conversation.append(turns)
    ordered = [turns[t] for t in range(TURNS) for turns in turns_by_conversation]
    return ordered[:requests]


def write_dataset(
    path: Path,
    input_len: int,
    requests: int,
    output_len: int,
    seed: int,
    count_tokens: Callable[[str], int],
) -> Path:
    """The point's requests as ``vllm bench serve``'s custom dataset at ``path``."""
    prompts = conversations(input_len, requests, seed, count_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for prompt in prompts:
            out.write(json.dumps({"prompt": prompt, "output_tokens": output_len}) + "\n")
    return path


def tokenizer_counter(model_dir: Path) -> Callable[[str], int]:
    """The model's tokenizer as a token counter (no special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
