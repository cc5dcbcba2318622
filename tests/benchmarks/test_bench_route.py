"""``kvpush bench route``: a small run measures every case of its table."""

from __future__ import annotations

import argparse

import pytest

from kvpush.benchmarks import route


def test_a_small_run_measures_every_case_with_its_prefix_hit() -> None:
    results = route.run(prefixes=64, repeats=5, seed=1, rounds=2)
    cases = results["cases"]
    assert [(c["prompt_tokens"], c["hit_share"]) for c in cases] == [
        (n, s) for n in route.LENGTHS for s in route.HIT_SHARES
    ]
    for case in cases:
        expected = int(case["prompt_tokens"] * case["hit_share"]) // route.BLOCK_SIZE
        assert case["cached_tokens"] == expected * route.BLOCK_SIZE
        assert case["reason"] == "cost" and case["p50_us"] > 0 and case["lookup_p50_us"] > 0
        assert case["at_bound_p50_us"] > 0
        assert case["choice"].split()[0] in ("local", "push")  # a push deployment
    assert results["meta"]["index_entries"] > 0
    assert "| 8192 | 90% |" in route.table(results)
    assert results["meta"]["rounds"] == 2
    assert all(len(c["p50_us_rounds"]) == 2 for c in cases)
    assert "in each of 2 rounds" in route.table(results)


def test_rounds_and_repeats_below_one_are_refused_at_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    assert parser.parse_args(["--rounds", "3"]).rounds == 3
    for given in (["--rounds", "0"], ["--repeats", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(given)
    with pytest.raises(ValueError, match="rounds"):
        route.run(prefixes=8, repeats=1, seed=1, rounds=0)
