"""The transfer check of every benchmark point: was each request served with a KV transfer?

A disaggregated system that quietly computes prompts on its decode engine measures something
else than the benchmark claims, so every point of every such system is checked, and fails when
any request was served without a transfer (or could not be verified). How, per system kind
(``System.transfer``):

``gateway`` (kvpush-push, kvpush-pull): the gateway's ``/metrics`` before and after the point.
  ``kvpush_gateway_routed_requests{mode}`` must grow only in the system's mode (never
  ``local``: the requests name their mode, so the gateway cannot degrade to local, but a
  routed-local request would be caught here too) and ``kvpush_gateway_kv_outcomes{mode,
  outcome}`` must count every request served OK as ``received`` or ``cached`` (D's own prefix
  cache held the prompt, as vLLM's random dataset repeats a prompt now and then with a small
  vocabulary: nothing to move, as a vLLM peer's D reporting the prompt cached passes its check;
  ``fallback``: D computed the prompt itself after a failed transfer). The gateway counts an
  outcome right after the request's last chunk, so the snapshot after the point waits (up to
  ``SETTLE_S``) until the outcomes add up to the requests served.

``proxy`` (vllm-pull, vllm-push): the proxy's ``GET /proxy/stats`` ``no_kv_params`` before
  and after (P answered without ``kv_transfer_params``: D has nothing to load), and per request
  the cached prompt tokens D reports in its usage (``--enable-prompt-tokens-details``), as the
  proxy counted them passing through (``d_loaded`` / ``d_computed`` / ``d_unverified``), else as
  the client read them; ``cached_rule`` says which count means "D loaded the KV".

``none`` (aggregated): nothing moves; the check does not apply (n/a).

What the kvpush gateway says of a point's requests (its TTFT breakdown and routing decisions)
is read by ``gateway_rows.py``.

Threading model: asyncio on the bench's loop (one short HTTP GET per snapshot); the
``*_check``, ``*_of`` functions are pure.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpush.benchmarks.serve.loadgen import RequestResult
from kvpush.benchmarks.serve.results import NOT_APPLICABLE, TransferCheck

SETTLE_S = 5.0
PROXY_USAGE = ("d_loaded", "d_computed", "d_unverified")  # the proxy's counts of D's usage
PREFILL_BACKOFF_TOKENS = 0
"""Prompt tokens vLLM's NixlConnector leaves for D to recompute (``_prefill_backoff`` in
``nixl/base_scheduler.py``): 0 for a decoder-only Llama (only Mamba, DSV4 bounded replay and
multi-module MTP hold some back)."""


def cached_rule(prompt_tokens: int, cached_tokens: int | None) -> bool:
    """True when D's reported cached prompt tokens show that it loaded the prompt's KV.

    How vLLM 0.32 counts them (paths under ``vllm/``): D's connector scheduler asks for
    ``_get_remote_prefill_token_count(len(prompt)) - local_hit`` external tokens, i.e. the whole
    prompt past D's own block-aligned prefix hit (``nixl/pull_scheduler.py`` and
    ``nixl/push_scheduler.py``, ``get_num_new_matched_tokens``); the scheduler records
    ``prefill_stats.set(num_local_cached_tokens=local_hit, num_external_cached_tokens=external)``
    when it first schedules the request (``v1/core/sched/scheduler.py``, ``schedule``), so a
    transfer reports local + external = every prompt token (the last one is recomputed after
    the load, ``_update_waiting_for_remote_kv``, but the stats are already set). The output
    processor copies ``prefill_stats.num_cached_tokens`` to the request
    (``v1/engine/output_processor.py``) and the completions server reports it as
    ``usage.prompt_tokens_details.cached_tokens`` (``entrypoints/openai/completion/
    serving.py``). A D that computes the prompt itself reports only its local prefix hit,
    which vLLM caps at ``num_tokens - 1`` in whole blocks (``v1/core/kv_cache_manager.py``,
    ``max_cache_hit_length``). A load that fails as a whole (``kv_load_failure_policy:
    recompute``) resets the request to 0 computed tokens, so it is scheduled afresh and the
    stats are set again with D's own hit: visible here. Not visible: a partial failure
    (invalid blocks truncate the computed tokens but keep the first stats) and a recompute
    after preemption (stats are kept from the first scheduling).

    Hence: loaded iff ``cached_tokens >= prompt_tokens - PREFILL_BACKOFF_TOKENS``; a missing
    count (no usage details) cannot be verified and counts as not loaded.
    """
    return cached_tokens is not None and cached_tokens >= prompt_tokens - PREFILL_BACKOFF_TOKENS


# -- kvpush: the gateway's counters ------------------------------------------------------------


def gateway_counts(text: str) -> dict[str, float]:
    """``routed.<mode>`` and ``outcome.<mode>.<outcome>`` from the gateway's /metrics text."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name == "kvpush_gateway_routed_requests":
                key = f"routed.{sample.labels.get('mode', '')}"
            elif name == "kvpush_gateway_kv_outcomes":
                labels = sample.labels
                key = f"outcome.{labels.get('mode', '')}.{labels.get('outcome', '')}"
            else:
                continue
            counts[key] = counts.get(key, 0.0) + float(sample.value)
    return counts


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted({*before, *after})}


def _sum(counts: dict[str, float], prefix: str, suffix: str = "") -> int:
    return int(sum(v for k, v in counts.items() if k.startswith(prefix) and k.endswith(suffix)))


def gateway_check(
    before: dict[str, float], after: dict[str, float], completed: int, mode: str
) -> TransferCheck:
    """The check of a kvpush point from the counters around it (``completed``: served OK)."""
    d = _delta(before, after)
    received = _sum(d, "outcome.", ".received")
    cached = _sum(d, "outcome.", ".cached")  # D's prefix cache held the prompt: counts as served
    fallback = _sum(d, "outcome.", ".fallback")
    other_modes = _sum(d, "routed.") - int(d.get(f"routed.{mode}", 0))
    without = max(completed - received - cached, fallback + other_modes, 0)
    problems = []
    if fallback:
        problems.append(f"{fallback} fallback (D computed the prompt)")
    if other_modes:
        routed = ", ".join(
            f"{k.split('.', 1)[1]} {v:g}"
            for k, v in d.items()
            if k.startswith("routed.") and k != f"routed.{mode}" and v
        )
        problems.append(f"routed not {mode}: {routed}")
    held = f" + {cached} cached at D" if cached else ""
    if received + cached != completed:
        problems.append(f"received {received}{held} of {completed} served")
    if not completed:
        problems.append("no request served: nothing to check")
    detail = "; ".join(problems) or f"received {received}{held}/{completed}"
    return TransferCheck(
        applies=True,
        ok=not problems,
        checked=completed,
        without_transfer=without,
        detail=detail,
        counts={k: v for k, v in d.items() if v},
    )


# -- vLLM's pairs: the proxy's count and D's cached tokens ---------------------------------------


def proxy_check(
    before: dict[str, Any], after: dict[str, Any], results: list[RequestResult]
) -> TransferCheck:
    """The check of a vllm-pull / vllm-push point (proxy stats around it + D's usage)."""
    keys = ("requests", "no_kv_params", "prefill_failed", "decode_failed")
    missing = [key for key in keys if key not in before or key not in after]
    counts = {key: float(after.get(key, 0) - before.get(key, 0)) for key in keys}
    no_kv = int(counts["no_kv_params"])
    served = [r for r in results if r.error is None and r.ttft_s is not None]
    if "d_loaded" in after and "d_loaded" in before:  # the proxy read D's usage itself
        d = {k: int(after.get(k, 0) - before.get(k, 0)) for k in PROXY_USAGE}
        computed, unverified = d["d_computed"], d["d_unverified"]
        unverified += max(0, len(served) - sum(d.values()))  # served, yet no answer counted
    else:  # the client's reading of D's usage (kvpush's load generator)
        unverified = sum(1 for r in served if r.cached_tokens is None)
        computed = sum(
            1
            for r in served
            if r.cached_tokens is not None
            and not cached_rule(r.prompt_tokens or r.input_len, r.cached_tokens)
        )
    counts.update(unverified=float(unverified), d_computed=float(computed))
    without = max(no_kv, computed + unverified)
    problems = []
    if no_kv:
        problems.append(f"{no_kv} P answers without kv_transfer_params")
    if computed:
        counted = [r.cached_tokens for r in served if r.cached_tokens is not None]
        worst = f" (min {min(counted)})" if counted else ""
        problems.append(f"{computed} with D's cached tokens below the prompt{worst}")
    if unverified:
        problems.append(f"{unverified} without prompt_tokens_details")
    if missing:
        problems.append(f"proxy stats without {', '.join(missing)}")
    elif int(counts["requests"]) != len(results):
        problems.append(f"the proxy saw {int(counts['requests'])} of {len(results)} requests")
    if not served:
        problems.append("no request served: nothing to check")
    detail = "; ".join(problems) or f"KV loaded for {len(served)}/{len(served)}"
    return TransferCheck(
        applies=True,
        ok=not problems,
        checked=len(served),
        without_transfer=without,
        detail=detail,
        counts={k: v for k, v in counts.items() if v},
    )


# -- snapshots around a point ------------------------------------------------------------------


async def http_get(url: str) -> tuple[int, str]:
    """GET ``url``: its status and text (10 s at most)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp,
    ):
        return resp.status, await resp.text()


class PointProbe:
    """``before()`` ahead of a point, ``after(results)`` once it ended: its ``TransferCheck``.

    A snapshot that cannot be read fails the point (the check could not be made)."""

    def __init__(self, transfer: str, url: str, mode: str = "") -> None:
        if transfer not in ("gateway", "proxy", "none"):
            raise ValueError(f"unknown transfer kind {transfer!r}")
        self.transfer, self.url, self.mode = transfer, url, mode
        self._before: Any = None
        self._error = ""

    async def _snapshot(self) -> Any:
        if self.transfer == "gateway":
            status, text = await http_get(f"{self.url}/metrics")
            if status != 200:
                raise RuntimeError(f"/metrics: HTTP {status}")
            return gateway_counts(text)
        status, text = await http_get(f"{self.url}/proxy/stats")
        if status != 200:
            raise RuntimeError(f"/proxy/stats: HTTP {status}")
        try:
            stats = json.loads(text)
        except ValueError as exc:
            raise RuntimeError(f"/proxy/stats: not JSON ({exc})") from None
        if not isinstance(stats, dict):
            raise RuntimeError("/proxy/stats: not a JSON object")
        return stats

    async def before(self) -> None:
        if self.transfer == "none":
            return
        try:
            self._before = await self._snapshot()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, RuntimeError) as exc:
            self._error = f"snapshot before the point failed: {exc!r}"[:300]

    async def after(self, results: list[RequestResult]) -> TransferCheck:
        if self.transfer == "none":
            return NOT_APPLICABLE
        completed = sum(1 for r in results if r.error is None and r.ttft_s is not None)
        if self._error:
            return TransferCheck(applies=True, ok=False, checked=0, detail=self._error)
        try:
            after = await self._snapshot()
            if self.transfer == "proxy":
                return proxy_check(self._before, after, results)
            deadline = time.monotonic() + SETTLE_S
            while _outcomes(self._before, after) < completed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                after = await self._snapshot()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, RuntimeError) as exc:
            detail = f"snapshot after the point failed: {exc!r}"[:300]
            return TransferCheck(applies=True, ok=False, checked=0, detail=detail)
        return gateway_check(self._before, after, completed, self.mode)


def _outcomes(before: dict[str, float], after: dict[str, float]) -> int:
    return _sum(_delta(before, after), "outcome.")
