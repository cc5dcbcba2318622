"""Request migration: what the gateway keeps of a request to move it to other workers, and when.

A request moves when the worker answering it is lost (docs/bus.md, membership): its decode
worker died or restarted (``Lost.DECODE``: noticed within that worker's lease), its prefill
worker did before the first token (``Lost.PREFILL``; past the first token D has all it needs of
P), or the gateway's bus connection broke and came back while the request's stream stalled
(``Lost.BUS``: core NATS delivers at most once, so chunks sent during the gap are gone). The
move (``bus_generation.BusGeneration``) is a new transfer id, a fresh route (through a prefill
worker when one is alive, else local; a request that lost its prefill worker moves only to
another one) and one RequestEvent whose prompt is the original prompt
plus every token the client was sent (``sent_ids``), asking for the tokens still owed
(``owed``: ``max_tokens`` and ``min_tokens`` less those sent). The client's stream goes on with
no token repeated or missing; under greedy sampling it equals an unbroken run.

A request does not move (``movable``) past ``--migration-limit`` moves, for ``n`` > 1 or the
prompt's log-probabilities (answers and logits only D keeps), and once tokens were sent, with
stop strings (D holds back text that may begin a stop string: it would be lost) or sampling
that depends on the answer so far (a grammar, allowed tokens, presence or frequency penalties,
bad words, a seed: ``connector.samples_on_prefill``'s list; the new decode worker would read
the sent tokens as prompt). With
nowhere to move it (no decode worker alive), a request whose decode worker was lost fails at
once with a 502, unless the bus broke meanwhile (a nats-server restart: every worker's lease
runs out at the gateway although the workers live): then it waits up to ``bus_grace_s`` for
the workers to be heard again, and fails with a 503 past it. A lost prefill worker with no other
one alive needs no move at first: its decode worker computes the prompt itself once P's side
channel port refuses (a dead process). A stopped or hung P is not dead (D keeps the blocks it
may still write into: connector/vllm/probes.py), so past a grace (``PREFILL_GRACE_LEASES``
leases) without a first token the request moves to LOCAL, in fresh blocks.

Threading model: plain data, used by one ``BusGeneration`` on the gateway's loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from kvpush.connector import samples_on_prefill
from kvpush.schemas.messages import TokenChunk, WorkerRole
from kvpush.schemas.sampling import SamplingSpec
from kvpush.services.gateway.routing import Route, Router


class Lost(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"
    BUS = "bus"


@dataclass
class Migration:
    """One request's moves; see the module docstring."""

    limit: int
    sampling: SamplingSpec
    reconnects: int  # the bus's reconnect count when the request was last published
    sent_ids: list[int] = field(default_factory=list)  # the answer's tokens (n = 1)
    count: int = 0
    tokens_before: int = 0  # completion tokens sent before the last move
    stuck_at: float | None = None  # when a loss with nowhere to move was first seen

    def record(self, chunk: TokenChunk) -> None:
        """A chunk reached the client: its tokens are part of the answer."""
        if self.sampling.n == 1:
            self.sent_ids += chunk.token_ids
            for output in chunk.outputs or []:
                self.sent_ids += output.token_ids

    def movable(self) -> bool:
        spec = self.sampling
        # what only the answer so far decides (min_tokens is owed less what was sent)
        free = samples_on_prefill(msgspec.structs.replace(spec, logprobs=None, min_tokens=0))
        return (
            self.count < self.limit
            and spec.n == 1
            and spec.prompt_logprobs is None
            and not (self.sent_ids and (spec.stop or not free))
            and len(self.sent_ids) < spec.max_tokens
        )

    def delivered(self, reconnects: int) -> None:
        """A chunk came in order: nothing was lost before it (a bus break included)."""
        self.reconnects, self.stuck_at = reconnects, None

    def lost(self, router: Router, route: Route, answered: bool, reconnects: int) -> Lost | None:
        """What the request lost (None: nothing); ``answered``: its first token came."""
        role = router.lost(route)
        if role is WorkerRole.DECODE:
            return Lost.DECODE
        if role is WorkerRole.PREFILL and not answered:
            return Lost.PREFILL
        return Lost.BUS if reconnects != self.reconnects else None

    def moved(self, reconnects: int) -> tuple[list[int], SamplingSpec]:
        """Count a move: the prompt's extra tokens and the sampling of what is still owed."""
        self.count += 1
        self.reconnects, self.stuck_at = reconnects, None
        done = self.tokens_before = len(self.sent_ids)
        spec = self.sampling
        owed = msgspec.structs.replace(
            spec, max_tokens=spec.max_tokens - done, min_tokens=max(0, spec.min_tokens - done)
        )
        return list(self.sent_ids), owed

    def waits(self, lost: Lost, now: float, bus_broke: bool, bus_grace_s: float) -> bool:
        """With nowhere to move it: whether the request still waits for workers (the bus broke,
        or its P was lost and D's own fallback may still come, and ``bus_grace_s`` has not
        passed since the loss was first seen), or fails now (a lost P: moves to LOCAL)."""
        if self.stuck_at is None:
            self.stuck_at = now
        if lost is Lost.PREFILL:  # D computes the prompt itself once it finds P dead
            return now - self.stuck_at < bus_grace_s
        return (bus_broke or lost is Lost.BUS) and now - self.stuck_at < bus_grace_s
