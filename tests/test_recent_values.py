"""A window of recent values (scheduler.policies.recent: γ-Ada's, a length predictor's pools): a
ring that keeps the last values like a bounded deque, and percentiles bit for bit numpy's."""

from __future__ import annotations

import pickle
import random
from collections import deque

import numpy as np
import pytest

from scheduler.policies.recent import RecentValues, linear_percentiles


def test_the_window_keeps_the_last_values_in_order_like_a_bounded_deque():
    rng = random.Random(7)
    for capacity in (1, 3, 10, 64, 65, 200):
        window, reference = RecentValues(capacity), deque(maxlen=capacity)
        for _ in range(3 * capacity + 5):
            value = rng.uniform(-5.0, 500.0)
            window.append(value)
            reference.append(value)
            assert len(window) == len(reference)
            assert list(window) == list(reference)
            assert window[-1] == reference[-1] and window[0] == reference[0]
            assert sorted(window.values().tolist()) == sorted(reference)
            assert window.ordered().tolist() == list(reference)
    copy = RecentValues(5, window)  # a policy switch carries the last values over
    assert list(copy) == list(reference)[-5:]
    assert list(pickle.loads(pickle.dumps(window))) == list(window)  # the autopilot forks it
    with pytest.raises(IndexError):
        RecentValues(4, [1.0])[1]


def test_an_empty_window_stays_empty():
    window = RecentValues(0)
    window.extend([1.0, 2.0])
    assert len(window) == 0 and list(window) == []


def test_percentiles_are_numpys_bit_for_bit():
    rng = np.random.default_rng(3)
    percents = (95.0, 99.0, 50.0, 0.0, 100.0, 12.5)
    for n in [*range(1, 40), 199, 200, 1999, 2000]:
        for values in (
            rng.exponential(3.0, n),
            rng.integers(0, 4, n).astype(float),  # ties
            np.full(n, 2.5),
        ):
            got = linear_percentiles(values.copy(), percents)
            want = np.percentile(values, list(percents))
            assert [float(x) for x in want] == got, n
