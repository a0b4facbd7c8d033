"""loadtest.bench_fairness: the bootstrap interval printed beside the p99 ratio."""

import random

from loadtest.bench_fairness import ratio_interval
from loadtest.bench_router import _pct


def test_the_interval_brackets_the_ratio_and_narrows_with_more_samples():
    rng = random.Random(1)
    alone = [rng.lognormvariate(4.0, 0.15) for _ in range(400)]
    beside = [1.3 * x for x in (rng.lognormvariate(4.0, 0.15) for _ in range(400))]
    low, high = ratio_interval(beside, alone)
    ratio = _pct(beside, 0.99) / _pct(alone, 0.99)
    assert low <= ratio <= high
    assert low < 1.3 < high  # the true ratio of the two distributions
    more_alone = [rng.lognormvariate(4.0, 0.15) for _ in range(6400)]
    more_beside = [1.3 * rng.lognormvariate(4.0, 0.15) for _ in range(6400)]
    low2, high2 = ratio_interval(more_beside, more_alone, resamples=300)
    assert high2 - low2 < (high - low) / 2


def test_the_interval_is_seeded():
    xs = [float(i) for i in range(1, 300)]
    ys = [1.1 * x for x in xs]
    assert ratio_interval(ys, xs, seed=3) == ratio_interval(ys, xs, seed=3)
    low, high = ratio_interval(ys, ys)
    assert low <= 1.0 <= high
