"""The routed choice (``route_choice.choose``) ranks only the candidates that can still be kept
(LOCAL on the cheapest few D, the other P's pairs no dearer than the cheapest few ranked): on
random fleets (loads, GPUs, prefix hits, measured rates, ties) it must pick, explain and carry
exactly what ranking every candidate of its pairs picks, as it did before it pruned; and the
cost model's per-request parts must be the estimates' totals."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from kvpush.schemas.messages import Timing, TransferMode, WorkerRole
from kvpush.services.gateway.cost_model import Candidate, CostModel, Estimate, TransferShare
from kvpush.services.gateway.device_share import others as device_others
from kvpush.services.gateway.route_choice import (
    ALTERNATIVES,
    choose,
    decode_order,
    prefill_order,
)
from kvpush.services.gateway.worker_registry import WorkerRegistry, WorkerState
from tests.unit.beats import Clock, beat, others_on_device

P, D = WorkerRole.PREFILL, WorkerRole.DECODE
LOCAL, PUSH, PULL = TransferMode.LOCAL, TransferMode.PUSH, TransferMode.PULL
MS = 1_000_000  # ns
MODES = [(LOCAL, PUSH), (LOCAL, PULL), (PUSH,), (PULL,), (LOCAL,), (PUSH, LOCAL)]


def device_shares(
    model: CostModel,
    sums: Mapping[str, float] | None,
    p_rows: list[tuple[str, int, int]],
    p_gpus: list[str],
    d_rows: list[tuple[str, int, int, int]],
    d_gpus: list[str],
) -> tuple[list[float], list[float]]:
    """Each P's and each D's share of its device's queue, the other engines' (as ``choose``
    gives its candidates)."""
    p_device = [
        device_others(sums, g, model.wait_ms(w, load))
        for (w, load, _), g in zip(p_rows, p_gpus, strict=True)
    ]
    d_device = [
        device_others(sums, g, model.wait_ms(w, max(0, load - run)))
        for (w, load, run, _), g in zip(d_rows, d_gpus, strict=True)
    ]
    return p_device, d_device


def ranked_in_full(
    model: CostModel,
    prompt_tokens: int,
    hits: Mapping[str, int],
    decodes: Sequence[WorkerState],
    prefills: Sequence[WorkerState],
    modes: Sequence[TransferMode],
) -> tuple[WorkerState, WorkerState | None, Estimate, tuple[Estimate, ...], WorkerState | None]:
    """The choice as ranked before pruning: LOCAL on every D; per transfer mode, each of the
    ``ALTERNATIVES`` + 1 cheapest D's cheapest pair (the cheapest P, in turns on its GPU, or
    the cheapest P elsewhere) and every pair of the other few cheapest P with those D; all of
    them sorted (decode, prefill, choice, runners-up, carrier)."""
    whole, most = max(prompt_tokens, 0), prompt_tokens - 1

    def hit(worker_id: str) -> int:
        return max(0, min(hits[worker_id], most)) if worker_id in hits else 0

    d_rows = [(d.worker_id, *d.load_running(), whole - hit(d.worker_id)) for d in decodes]
    p_rows = [(p.worker_id, p.load, whole - hit(p.worker_id)) for p in prefills]
    d_keys, p_keys = [decode_order(d) for d in decodes], [prefill_order(p) for p in prefills]
    p_gpus, d_gpus = [p.gpu for p in prefills], [d.gpu for d in decodes]
    sums = model.device_sums(p_rows, p_gpus, d_rows, d_gpus) if any(p_gpus + d_gpus) else None
    p_device, d_device = device_shares(model, sums, p_rows, p_gpus, d_rows, d_gpus)
    p_parts = model.prefill_parts(p_rows, p_gpus, sums)
    ranked: list[tuple] = []
    for mode in modes:
        local_parts, terms = model.decode_parts(
            None if mode is LOCAL else mode, d_rows, d_gpus, sums
        )
        if mode is LOCAL:
            ranked += [(cost, 0, d_keys[i], (), -1, i) for i, cost in enumerate(local_parts)]
            continue
        shares = [TransferShare(*share) for share in terms]
        rank = 1 if mode is PUSH else 2
        priced = list(zip(p_parts, p_keys, range(len(prefills)), strict=True))
        by_part = sorted(priced)[: ALTERNATIVES + 1]
        cheapest, *others = by_part
        gpu = prefills[cheapest[2]].gpu
        away = min(
            (e for e in priced if prefills[e[2]].gpu != gpu),
            default=None,
        )
        best = []  # each D's cheapest pair: (total, P key, P)
        for i, d in enumerate(decodes):
            pair = (shares[i].total(cheapest[0]), cheapest[1], cheapest[2])
            if gpu and d.gpu == gpu:
                pair = (shares[i].in_turns(cheapest[0]), cheapest[1], cheapest[2])
                if away is not None and shares[i].total(away[0]) < pair[0]:
                    pair = (shares[i].total(away[0]), away[1], away[2])
            best.append(pair)
        top = sorted((pair[0], d_keys[i], i) for i, pair in enumerate(best))[: ALTERNATIVES + 1]
        ranked += [(cost, rank, key, best[i][1], best[i][2], i) for cost, key, i in top]
        for part, p_key, j in others:
            for _, key, i in top:
                if j == best[i][2]:
                    continue  # in already
                shared = bool(prefills[j].gpu) and prefills[j].gpu == decodes[i].gpu
                cost = shares[i].in_turns(part) if shared else shares[i].total(part)
                ranked.append((cost, rank, key, p_key, j, i))
    ranked.sort()
    estimates = []
    for cost, rank, _, _, j, i in ranked[: ALTERNATIVES + 1]:
        d_id, load, running, missing = d_rows[i]
        if j < 0:
            candidate = Candidate(
                LOCAL, d_id, load, whole - missing, prompt_tokens, None, 0, 0, running
            )._replace(decode_device_ms=d_device[i])
        else:
            p_id, p_load, p_missing = p_rows[j]
            shared = bool(prefills[j].gpu) and prefills[j].gpu == decodes[i].gpu
            mode = PUSH if rank == 1 else PULL
            candidate = Candidate(
                mode,
                d_id,
                load,
                whole - missing,
                prompt_tokens,
                p_id,
                p_load,
                whole - p_missing,
                running,
                shared,
                p_device[j],
                d_device[i],
            )
        estimates.append(Estimate(candidate, cost) if estimates else model.estimate(candidate))
    best_p, best_d = ranked[0][4], ranked[0][5]
    prefill = prefills[best_p] if best_p >= 0 else None
    carrier = None
    if prefill is None and any(mode is not LOCAL for mode in modes):
        carrier = min(prefills, key=prefill_order)
    return decodes[best_d], prefill, estimates[0], tuple(estimates[1:]), carrier


def random_fleet(
    rng: random.Random,
) -> tuple[CostModel, list[WorkerState], list[WorkerState], dict[str, int], int]:
    """Up to 8 P and 8 D with random loads, GPUs and picks (ties likely: loads and free blocks
    from few values or all alike, picks often at one instant), measured rates and prefix hits."""
    clock = Clock()
    registry = WorkerRegistry(lease_s=1e9, clock=clock)
    alike = rng.random() < 0.3
    gpus = rng.choice([[""], ["", "g0", "g1"], ["g0", "g1", "g2"], ["g0"], ["g0", "g1"]])
    names = [f"p{n}" for n in range(rng.randrange(1, 9))]
    names += [f"d{n}" for n in range(rng.randrange(1, 9))]
    for name in names:
        queued, running = (1, 1) if alike else (rng.randrange(4), rng.randrange(5))
        registry.observe(
            beat(
                P if name[0] == "p" else D,
                name,
                in_flight=queued + (running if name[0] == "d" else 0),
                queue_depth=queued,
                free_blocks=100 if alike else rng.choice([100, 200, 300]),
                gpu=rng.choice(gpus),
            )
        )
    decodes, prefills = registry.alive(D), registry.alive(P)
    for state in rng.choices([*decodes, *prefills], k=rng.randrange(6)):
        clock.now += rng.choice([0.0, 0.0, 1.0])
        registry.mark(state, running=rng.random() < 0.5)
    model = CostModel()
    for _ in range(rng.randrange(3, 8)):  # warm: every mode is scored
        compute, tail, step = rng.randrange(5, 200), rng.randrange(5), rng.randrange(1, 9)
        end = 10 + compute
        timing = Timing(
            prefill_received=2 * MS,
            prefill_start=10 * MS,
            prefill_end=end * MS,
            kv_sent=(end + tail) * MS,
            kv_landed=(end + tail + 1) * MS,
            first_token=(end + tail + 1 + step) * MS,
        )
        prefill, decode = rng.choice(prefills).worker_id, rng.choice(decodes).worker_id
        model.learn(PUSH, prefill, decode, rng.randrange(100, 4000), timing=timing, published_ns=MS)
    for _ in range(rng.randrange(4)):  # LOCAL prefills and joins on some D
        start, took = rng.randrange(1, 100), rng.randrange(5, 300)
        timing = Timing(decode_received=start * MS, first_token=(start + took) * MS)
        decode = rng.choice(decodes).worker_id
        tokens, running = rng.randrange(100, 4000), rng.randrange(3)
        model.learn(LOCAL, None, decode, tokens, cached_tokens=0, timing=timing, running=running)
    hits = {name: rng.randrange(0, 9000) // 16 * 16 for name in names if rng.random() < 0.4}
    return model, decodes, prefills, hits, rng.choice([0, 1, 17, 300, 1000, 4096, 8192])


@pytest.mark.parametrize("seed", range(600))
def test_pruned_ranking_picks_and_explains_as_ranking_every_candidate(seed: int) -> None:
    rng = random.Random(seed)
    model, decodes, prefills, hits, prompt_tokens = random_fleet(rng)
    for modes in MODES:
        picked = choose(model, prompt_tokens, hits, decodes, prefills, modes)
        decode, prefill, choice, alternatives, carrier = ranked_in_full(
            model, prompt_tokens, hits, decodes, prefills, modes
        )
        assert (picked.decode, picked.prefill, picked.carrier) == (decode, prefill, carrier)
        assert picked.choice == choice  # the candidate, its total and its terms, to the bit
        assert picked.alternatives == alternatives


@pytest.mark.parametrize("seed", range(100))
def test_the_choice_is_the_cheapest_of_every_candidate(seed: int) -> None:
    """Against every LOCAL D and every (P, D) pair, each priced alone."""
    model, decodes, prefills, hits, prompt_tokens = random_fleet(random.Random(seed))
    picked = choose(model, prompt_tokens, hits, decodes, prefills, (LOCAL, PUSH))
    most = prompt_tokens - 1

    def hit(state: WorkerState) -> int:
        return max(0, min(hits.get(state.worker_id, 0), most))

    def device(state: WorkerState) -> float:  # the others' queued compute on its device
        return others_on_device(model, prefills, decodes, state)

    costs = [
        model.estimate(
            Candidate(
                LOCAL,
                d.worker_id,
                d.load,
                hit(d),
                prompt_tokens,
                decode_running=d.running,
                decode_device_ms=device(d),
            )
        ).total_ms
        for d in decodes
    ]
    costs += [
        model.estimate(
            Candidate(
                PUSH,
                d.worker_id,
                d.load,
                hit(d),
                prompt_tokens,
                p.worker_id,
                p.load,
                hit(p),
                decode_running=d.running,
                shared_gpu=bool(p.gpu) and p.gpu == d.gpu,
                prefill_device_ms=device(p),
                decode_device_ms=device(d),
            )
        ).total_ms
        for d in decodes
        for p in prefills
    ]
    assert picked.choice.total_ms == pytest.approx(min(costs))
    assert all(a.total_ms >= picked.choice.total_ms - 1e-9 for a in picked.alternatives)


@pytest.mark.parametrize("seed", range(50))
def test_the_per_request_parts_are_the_estimates_totals(seed: int) -> None:
    """``decode_parts`` and ``prefill_parts`` price every worker per request; ``estimate``
    prices the choice with its terms: LOCAL's are the same sum, a pair's the same value."""
    rng = random.Random(seed)
    model, decodes, prefills, _, prompt_tokens = random_fleet(rng)
    missing = max(prompt_tokens, 0)
    d_rows = [(d.worker_id, *d.load_running(), missing) for d in decodes]
    p_rows = [(p.worker_id, p.load, missing) for p in prefills]
    p_gpus = [rng.choice(["", "g0", "g1"]) for _ in prefills]  # other engines on them queue
    d_gpus = [rng.choice(["", "g0", "g1"]) for _ in decodes]
    sums = model.device_sums(p_rows, p_gpus, d_rows, d_gpus)
    p_device, d_device = device_shares(model, sums, p_rows, p_gpus, d_rows, d_gpus)
    p_parts = model.prefill_parts(p_rows, p_gpus, sums)
    for mode in (PUSH, PULL):
        local_parts, shares = model.decode_parts(mode, d_rows, d_gpus, sums)
        for i, (d_id, load, running, _) in enumerate(d_rows):
            alone = Candidate(LOCAL, d_id, load, 0, prompt_tokens, decode_running=running)._replace(
                decode_device_ms=d_device[i]
            )
            assert local_parts[i] == model.estimate(alone).total_ms
            for j, (p, part) in enumerate(zip(prefills, p_parts, strict=True)):
                for shared in (False, True):
                    pair = Candidate(
                        mode, d_id, load, 0, prompt_tokens, p.worker_id, p.load, 0, running
                    )._replace(
                        shared_gpu=shared,
                        prefill_device_ms=p_device[j],
                        decode_device_ms=d_device[i],
                    )
                    share = TransferShare(*shares[i])
                    total = share.in_turns(part) if shared else share.total(part)
                    assert total == pytest.approx(model.estimate(pair).total_ms)
