"""loadtest.bench_router's pure parts: the percentile its tables (and other benchmarks')
use and the options every local benchmark takes. The run needs a Ray Serve stack
(``make bench-router``)."""

from __future__ import annotations

import math

from loadtest.bench_router import _pct, bench_parser


def test_pct_is_the_nearest_rank_from_below():
    values = [float(v) for v in range(100, 0, -1)]  # order does not matter
    assert _pct(values, 0.5) == 51.0
    assert _pct(values, 0.99) == 100.0
    assert _pct(values, 0.0) == 1.0
    assert _pct([7.0], 0.99) == 7.0
    assert math.isnan(_pct([], 0.5))


def test_the_parser_takes_a_config_and_rounds():
    p = bench_parser("x", rounds=3, round_s=8.0)
    args = p.parse_args([])
    assert (args.config, args.rounds, args.round_s) == ("cluster/local.yaml", 3, 8.0)
    args = p.parse_args(["--config", "c.yaml", "--rounds", "5", "--round-s", "2.5"])
    assert (args.config, args.rounds, args.round_s) == ("c.yaml", 5, 2.5)
