"""The helpers that replaced repeated code: backoff, figures, field errors."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from controlplane.views import fmt_figure
from scheduler.validation import describe_validation, field_path, finite_or_none
from storage.backoff import backoff_delays


def test_backoff_doubles_to_its_cap_with_jitter_in_the_upper_half():
    delays = list(itertools.islice(backoff_delays(0.1, 0.8, random.Random(1)), 8))
    steps = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8, 0.8, 0.8]
    assert all(s / 2 <= d <= s for d, s in zip(delays, steps, strict=True))
    # Jittered, not fixed.
    assert len({round(d / s, 6) for d, s in zip(delays, steps, strict=True)}) > 1


@pytest.mark.parametrize(
    "value,text",
    [
        (None, "—"),
        (math.nan, "—"),
        (math.inf, "—"),
        (True, "on"),
        (False, "off"),
        (12345.6, "12,346"),
        (3.14159, "3.142"),
        (7, "7"),
        ("x", "x"),
    ],
)
def test_a_figure_is_written_one_way(value, text):
    assert fmt_figure(value) == text


def test_an_ungrouped_figure_keeps_integers_and_more_digits():
    assert (
        fmt_figure(12345, grouped=False) == "12345"
        and fmt_figure(3.14159, sig=5, grouped=False) == "3.1416"
    )


def test_a_field_error_names_the_path():
    class Inner(BaseModel):
        port: int

    class Outer(BaseModel):
        items: list[Inner]

    with pytest.raises(ValidationError) as err:
        Outer.model_validate({"items": [{"port": 1}, {"port": "x"}]})
    assert describe_validation(err.value).startswith(
        "items[1].port: Input should be a valid integer"
    )
    assert field_path(()) == "document" and field_path((), "file") == "file"


def test_finite_or_none_keeps_finite_reals_only():
    assert finite_or_none(2) == 2.0 and isinstance(finite_or_none(2), float)
    assert finite_or_none(np.float64(2.5)) == 2.5 and finite_or_none(np.int64(3)) == 3.0
    for bad in (None, float("nan"), float("inf"), -np.inf, True, np.bool_(False), "3", [1.0]):
        assert finite_or_none(bad) is None, bad
