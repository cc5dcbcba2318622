"""Small HTTP helpers the stack tests share: one completion, one Prometheus sample.

Threading model: coroutines on the test's loop; one aiohttp session per call.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp

MODEL = "kvpush-tiny"


async def complete(
    url: str, prompt: str | list[int], mode: str, max_tokens: int = 8, **extra: Any
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a greedy /v1/completions request in ``mode``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"kvpush_mode": mode, **extra}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
        session.post(f"{url}/v1/completions", json=body) as resp,
    ):
        return resp.status, await resp.json()


async def completion_text(url: str, prompt: str, mode: str, max_tokens: int = 8) -> str:
    """The text of a successful completion (asserts the 200)."""
    status, answer = await complete(url, prompt, mode, max_tokens)
    assert status == 200, answer
    return str(answer["choices"][0]["text"])


async def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics (0 when absent); labels in exposition order."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    suffix = f"{{{wanted}}}" if wanted else ""
    match = re.search(rf"^{re.escape(name + suffix)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0
