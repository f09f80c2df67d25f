"""The operator side's one retry policy: when a request (or a write) is tried again, and how long
it waits first, on tenacity.

A :class:`RetryPolicy` is a few numbers — how many tries, until when, how long each wait — and a
caller says what calls for another try (an answer, e.g. HTTP 429, or an exception, e.g. a busy
store). What a try that is not retried gives is the caller's: the last answer when the tries run
out (a 429 the caller reports as such), the last exception when it raised one. Each caller's
numbers are named here, so that every retry the operator side makes reads in one place:

* :data:`POLL_RATE_LIMITED` — a replica's answer to one of the collector's GETs was 429 (it
  rate-limits its readers): 4 tries, waiting 0.1, 0.2 and 0.4 s, within the poll's timeout
  (``controlplane.replica_http``: polls, settings reads, the autopilot's reads);
* :data:`STEP_LOG_RATE_LIMITED` — a step-log page was answered 429
  (``tuner.closed_loop.calibrate``): the wait its ``Retry-After`` asks (1 s without one, at most
  5 s); the caller bounds the tries (60 waits while paging one log);
* :data:`READ_BACK` — a settings change accepted, read back until the replica runs it
  (``controlplane.steering``): waits of 0.02 s doubling to 0.5 s, until the caller's deadline;
* :data:`STORE_BUSY` — the collector's last flush, when the store stays busy
  (``controlplane.writer``): every 0.2 s until its deadline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")

#: The wait a 429 without a readable ``Retry-After`` gets, when a policy follows the header.
RETRY_AFTER_DEFAULT_S = 1.0


def rate_limited(answer: Any) -> bool:
    """Whether an HTTP answer says "too many requests" (429): the replica asks for a later try."""
    return getattr(answer, "status_code", None) == 429


def _retry_after_s(answer: Any, cap_s: float) -> float:
    """The seconds a 429's ``Retry-After`` asks for (:data:`RETRY_AFTER_DEFAULT_S` if absent or
    not a number), at most ``cap_s``."""
    header = (getattr(answer, "headers", None) or {}).get("Retry-After")
    try:
        return min(max(float(header or RETRY_AFTER_DEFAULT_S), 0.0), cap_s)
    except ValueError:
        return RETRY_AFTER_DEFAULT_S


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often, until when and after what wait a call is tried again.

    Attributes:
        attempts: tries in all, the first included; None: the deadline alone bounds them.
        deadline_s: no try starts later than this many seconds after the first began (the last
            wait is cut to end there); None: the tries alone bound them.
        first_wait_s: the wait after the first try; each next wait doubles, up to ``max_wait_s``.
        max_wait_s: the longest wait.
        retry_after: wait what the answer's ``Retry-After`` header asks instead (at most
            ``max_wait_s``; :data:`RETRY_AFTER_DEFAULT_S` without a number).
    """

    attempts: int | None = None
    deadline_s: float | None = None
    first_wait_s: float = 0.1
    max_wait_s: float = 5.0
    retry_after: bool = False

    def replace(self, **changes: Any) -> RetryPolicy:
        """This policy with some numbers changed (a caller's own deadline or budget of tries)."""
        return dataclasses.replace(self, **changes)

    def wait_s(self, state: tenacity.RetryCallState) -> float:
        """The wait before the next try, after the try ``state`` describes."""
        outcome = state.outcome
        if self.retry_after and outcome is not None and not outcome.failed:
            wait = _retry_after_s(outcome.result(), self.max_wait_s)
        else:
            wait = min(self.first_wait_s * 2 ** (state.attempt_number - 1), self.max_wait_s)
        if self.deadline_s is not None:
            wait = min(wait, max(self.deadline_s - (state.seconds_since_start or 0.0), 0.0))
        return wait

    def done(self, state: tenacity.RetryCallState) -> bool:
        """Whether the tries are over after the one ``state`` describes."""
        if self.attempts is not None and state.attempt_number >= self.attempts:
            return True
        return self.deadline_s is not None and (state.seconds_since_start or 0.0) >= self.deadline_s

    def _options(
        self,
        again: Callable[[Any], bool] | None,
        on: tuple[type[BaseException], ...],
        before_sleep: Callable[[tenacity.RetryCallState], None] | None,
    ) -> dict[str, Any]:
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("a retry policy needs a number of tries or a deadline")

        def retry(state: tenacity.RetryCallState) -> bool:
            outcome = state.outcome
            if outcome is None:
                return False
            if outcome.failed:
                return isinstance(outcome.exception(), on)
            return again is not None and again(outcome.result())

        def last_outcome(state: tenacity.RetryCallState) -> Any:
            assert state.outcome is not None
            return state.outcome.result()  # the last answer, or the last exception raised again

        return {
            "retry": retry,
            "stop": self.done,
            "wait": self.wait_s,
            "before_sleep": before_sleep,
            "retry_error_callback": last_outcome,
        }

    def call(
        self,
        fn: Callable[[], T],
        *,
        again: Callable[[T], bool] | None = None,
        on: tuple[type[BaseException], ...] = (),
        before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
    ) -> T:
        """``fn()``, tried again while ``again(answer)`` is true or it raises one of ``on``, as
        this policy allows; the last answer (or exception) when the tries run out.
        ``before_sleep`` is called before each wait (a caller's count of retries)."""
        result: T = tenacity.Retrying(**self._options(again, on, before_sleep))(fn)
        return result

    async def call_async(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        again: Callable[[T], bool] | None = None,
        on: tuple[type[BaseException], ...] = (),
        before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
    ) -> T:
        """:meth:`call` for a coroutine function; the waits are ``asyncio.sleep`` (a caller's
        ``asyncio.timeout`` bounds them too)."""

        async def attempt() -> T:
            return await fn()

        result: T = await tenacity.AsyncRetrying(**self._options(again, on, before_sleep))(attempt)
        return result


#: A GET of a poll answered 429: asked again after 0.1, 0.2 and 0.4 s (4 tries), all within the
#: poll's own timeout; the fourth 429 is the poll's answer.
POLL_RATE_LIMITED = RetryPolicy(attempts=4, first_wait_s=0.1, max_wait_s=0.4)
#: A step-log page answered 429: asked again after what its ``Retry-After`` says (at most 5 s);
#: the caller gives its budget of tries (``tuner.closed_loop.replica_facts.MAX_RATE_LIMITED``
#: per log).
STEP_LOG_RATE_LIMITED = RetryPolicy(retry_after=True, max_wait_s=5.0)
#: A settings change read back until the replica runs it: waits of 0.02 s doubling to 0.5 s; the
#: caller gives the deadline (``controlplane.steering.APPLY_WAIT_S`` by default).
READ_BACK = RetryPolicy(first_wait_s=0.02, max_wait_s=0.5)
#: The collector's final flush into a busy store: tried again every 0.2 s; the caller gives the
#: deadline (60 s by default), past which the store's error is raised.
STORE_BUSY = RetryPolicy(first_wait_s=0.2, max_wait_s=0.2)
