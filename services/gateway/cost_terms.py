"""The cost model's values: a candidate way to serve a prompt (``Candidate``), its estimate
(``Estimate``), one D's share of a transfer's estimate (``TransferShare``), what the
estimates read of a worker (``WorkerView``) and a learned mean (``Ewma``);
``cost_model.CostModel`` makes and reads them.

Threading model: immutable values, but for an ``Ewma``, which its owner (the gateway's loop)
updates in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NamedTuple

from kvpush.schemas.messages import TransferMode


class Candidate(NamedTuple):
    """One way to serve a prompt: a mode, its workers, and what the router knows of them."""

    mode: TransferMode
    decode_id: str
    decode_load: int
    decode_hit: int  # leading prompt tokens D's prefix cache holds
    prompt_tokens: int
    prefill_id: str | None = None  # None: LOCAL
    prefill_load: int = 0
    prefill_hit: int = 0
    decode_running: int = 0  # D's requests past their first token (inside decode_load)
    shared_gpu: bool = False  # P and D on one device: D's waiting prefills are in P's turns
    # the queued compute (ms) of the other engines on P's and on D's device (heartbeats' ``gpu``:
    # a GPU, or a CPU engine's pinned cores): they take turns with it
    prefill_device_ms: float = 0.0
    decode_device_ms: float = 0.0

    @property
    def label(self) -> str:
        if self.prefill_id is None:
            return f"{self.mode.value} {self.decode_id}"
        turns = " (one device)" if self.shared_gpu else ""  # the trace says why wait_d is 0
        return f"{self.mode.value} {self.prefill_id}>{self.decode_id}{turns}"


class Estimate(NamedTuple):
    """A candidate's estimated TTFT and the terms it adds up (ms; a runner-up's: none)."""

    candidate: Candidate
    total_ms: float
    terms: Mapping[str, float] = MappingProxyType({})

    def __str__(self) -> str:
        return f"{self.candidate.label} {self.total_ms:.1f}ms"

    @property
    def terms_text(self) -> str:
        """Its terms as the trace shows them: ``handoff 2.0; wait_p 0.0; device_p 512.3; ...``."""
        return "; ".join(f"{name} {ms:.1f}" for name, ms in self.terms.items())


PrefillRow = tuple[str, int, int]
"""What ``CostModel.prefill_parts`` reads of one P: its id, its load and the prompt tokens its
prefix cache lacks (a plain tuple: the router makes one per P per request)."""
DecodeRow = tuple[str, int, int, int]
"""What ``CostModel.decode_parts`` reads of one D: its id, its load, its requests past their
first token (part of its load) and the prompt tokens its prefix cache lacks."""
ShareTerms = tuple[float, float, float]
"""A ``TransferShare``'s fields as a plain tuple (``CostModel.decode_parts`` makes one per D per
request: no NamedTuple each; ``TransferShare(*terms)`` where its methods are wanted)."""


class TransferShare(NamedTuple):
    """One D's share of a push/pull estimate: its total for a P part is ``total(p)``."""

    fixed: float  # the hand-off and D's steps
    tail: float  # the transfer's tail of what D lacks (after P's compute)
    wait: float  # D's waiting LOCAL prefills and its device's other queued compute: they
    # overlap P's part and the tail

    def total(self, prefill_part: float) -> float:
        part = prefill_part + self.tail
        return self.fixed + (self.wait if self.wait > part else part)  # max(part, wait)

    def in_turns(self, prefill_part: float) -> float:
        """``total`` for a P on D's own device: D's waiting prefills take turns with P's, and
        are in P's part already (its device's queued compute), so only P's part and the tail."""
        return self.fixed + prefill_part + self.tail

    @staticmethod
    def totals(shares: Iterable[ShareTerms], prefill_part: float) -> list[float]:
        """Each share's ``total(prefill_part)``, in one pass (no call per share)."""
        return [
            fixed + (wait if wait > (part := prefill_part + tail) else part)
            for fixed, tail, wait in shares
        ]


class WorkerView(NamedTuple):
    """What the estimates use of one worker: its own measurements, else the fleet's."""

    ms_per_token: float
    service_ms: float
    step_ms: float
    join_ms: float  # what each decoding request adds to a LOCAL prompt's first step


EWMA_WEIGHT: Final = 0.2
"""Weight of a new sample in every EWMA (about the last ten requests count)."""


@dataclass(slots=True)
class Ewma:
    """An exponentially weighted mean; ``samples`` counts its updates (0: ``prior``)."""

    prior: float
    value: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        self.value = self.prior

    def update(self, sample: float) -> None:
        self.value = (
            sample if not self.samples else self.value + EWMA_WEIGHT * (sample - self.value)
        )
        self.samples += 1


def measured_of(own: Ewma | None, fleet: Ewma) -> Ewma:
    """A worker's own EWMA where it has samples, else the fleet's."""
    return own if own is not None and own.samples else fleet
