"""ReaderModel: the server's model of one client reading a token stream at a declared rate.

Contract (docs/design.md §6.1): the reader starts at the stream's first token
and consumes one token every 1/rate s while tokens are buffered; an empty buffer makes it wait (a stall).
Token j generated at g_j is consumed at c_0 = g_0, c_j = max(c_{j-1} + 1/rate, g_j), and
stall += max(0, g_j - (c_{j-1} + 1/rate)). rate = 0 is an unpaced reader: it takes every token at once,
its buffer is always 0 and it never stalls. Client reports replace the model from their time on.

Cost: the scheduler queries every stream every step, so state is advanced lazily. Unread tokens are kept as
runs (generation time, count); each query pops whole runs and splits at most one, so every call is O(1)
amortised. The price is that time only moves forward: every call takes a time >= the latest one seen.
"""

from __future__ import annotations

import math
from collections import deque

from tokenflow_ray.checks import check_count, check_rate, check_time

# Slack (in tokens) when counting reads up to t, so a read due exactly at t is not lost to rounding.
_READ_EPS = 1e-9
_INF = math.inf


class ReaderModel:
    """Server-side model of one client reader. All times are seconds on one clock, non-decreasing."""

    def __init__(self, rate: float) -> None:
        self._rate = check_rate(rate)
        self._generated = 0
        self._consumed = 0
        self._runs: deque[tuple[float, int]] = deque()  # unread tokens: (generation time, count)
        self._ready: float | None = None  # earliest time of the next read; None until the first token
        self._stall = 0.0  # banked stall seconds; an ongoing wait is added on query
        self._first: float | None = None
        self._now = -math.inf
        # A time at which every read due has been done and nothing has changed since, so `_advance` at it would
        # do nothing: the scheduler asks each stream's buffer several times a step at one time (None: not known).
        self._settled: float | None = None
        self._paused = False
        self._pause_left = 0.0  # time left to the next read when the pause began
        self._finished = False

    # ---- read-only state -------------------------------------------------------------------------
    @property
    def rate(self) -> float:
        return self._rate

    @property
    def generated(self) -> int:
        return self._generated

    @property
    def first_token_time(self) -> float | None:
        return self._first

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def finished(self) -> bool:
        return self._finished

    # ---- events ----------------------------------------------------------------------------------
    def on_tokens(self, t: float, n: int = 1) -> None:
        """n tokens were generated (emitted to the client) at time t."""
        t = self._check_now(t)
        check_count(n, "n", minimum=1)
        self._add_tokens(t, n)

    def buffer_then_token(self, t: float) -> int:
        """`buffer_at(t)` then `on_tokens(t)` for one token, checked and advanced once: the engine does this for
        every token it emits, so it is the hot path, written out here (what `_add_tokens` does for n = 1, with
        `_check_now`'s common case, `_advance`'s early exits and `_bank_wait` inline). Returns the buffer before
        the token."""
        if not (type(t) is float and -_INF < t < _INF and t >= self._now):
            t = self._check_now(t)  # raises, or an int time as a float
        if self._finished:
            raise ValueError("on_tokens after finish(): the stream is finished")
        runs, rate = self._runs, self._rate
        if self._paused or not runs:
            self._now = t
        elif rate == 0:  # unpaced: everything generated is read at once
            self._now = t
            self._consumed = self._generated
            runs.clear()
        elif t != self._settled:
            ready, head = self._ready, runs[0][0]
            if (ready if ready > head else head) <= t:  # a read is due (`_advance`'s first check, inline)
                self._advance(t)
            else:
                self._now = t
        buffered = self._generated - self._consumed
        ready = self._ready
        if ready is not None and ready < t and not runs and rate > 0 and not self._paused:
            self._stall += t - ready  # the wait so far becomes stall history (_bank_wait)
            self._ready = t
        if self._first is None:
            self._first = t
            self._ready = t  # c_0 = g_0: the reader starts at the first token, not a stall
        if runs and runs[-1][0] == t:
            runs[-1] = (t, runs[-1][1] + 1)
        else:
            runs.append((t, 1))
        self._generated += 1
        # Settled at t when `_advance(t)` would now stop at its first check: its head run's read is after t (or
        # nothing is read while paused). The scheduler asks every running stream's buffer at this time next.
        if self._paused:
            self._settled = t
        elif rate > 0:
            ready, head = self._ready, runs[0][0]
            self._settled = t if (head if head > ready else ready) > t else None
        else:
            self._settled = None  # unpaced: the new token is read at t
        return buffered

    def _add_tokens(self, t: float, n: int) -> int:
        """n tokens generated at t (already checked); returns the buffer at t before them."""
        if self._finished:
            raise ValueError("on_tokens after finish(): the stream is finished")
        self._advance(t)
        buffered = self._generated - self._consumed
        self._bank_wait(t)
        if self._first is None:
            self._first = t
            self._ready = t  # c_0 = g_0: the reader starts at the first token, not a stall
        runs = self._runs
        if runs and runs[-1][0] == t:
            runs[-1] = (t, runs[-1][1] + n)
        else:
            runs.append((t, n))
        self._generated += n
        self._settled = None
        return buffered

    def finish(self, t: float) -> None:
        """No more tokens will come. A wait still going on at t is not a stall (nothing was owed)."""
        t = self._check_now(t)
        if self._finished:
            raise ValueError("finish() called twice")
        self._advance(t)
        self._finished = True

    def apply_report(
        self,
        t: float,
        consumed_tokens: int | None = None,
        rate: float | None = None,
        paused: bool | None = None,
    ) -> None:
        """A client report replaces the model from time t on. Everything is validated before any change.

        consumed_tokens: the reader has read this many tokens at t (and reads the next 1/rate later).
        rate: new consumption rate from t; a read in progress is rescaled to the new rate.
        paused: True stops consumption (the buffer only grows, no stall accrues) until paused=False.
        Stall accrued under the old model up to t is kept.
        """
        t = self._check_now(t)
        if self._finished:
            raise ValueError("apply_report on a finished stream")
        if consumed_tokens is not None:
            check_count(consumed_tokens, "consumed_tokens")
            if consumed_tokens > self._generated:
                raise ValueError(
                    f"consumed_tokens={consumed_tokens} exceeds the {self._generated} tokens generated"
                )
        new_rate = None if rate is None else check_rate(rate)
        if paused is not None and not isinstance(paused, bool):
            raise ValueError(f"paused must be a bool, got {paused!r}")

        self._advance(t)
        self._bank_wait(t)
        self._settled = None
        if new_rate is not None:
            self._set_rate(t, new_rate)
        if consumed_tokens is not None:
            self._set_consumed(t, consumed_tokens)
        if paused is not None and paused != self._paused:
            self._set_paused(t, paused)

    # ---- queries (advance lazily; t must not go backwards) ---------------------------------------
    def consumed_at(self, t: float) -> int:
        self._advance(self._check_now(t))
        return self._consumed

    def buffer_at(self, t: float) -> int:
        """Tokens generated but not yet read at t (always >= 0)."""
        # The scheduler asks every live stream every step: at the settled time (a valid one, with nothing left to
        # do) the answer is read off; else `_check_now`'s common case and `_advance`'s first exit inline.
        if t != self._settled or type(t) is not float:
            if not (type(t) is float and -_INF < t < _INF and t >= self._now):
                t = self._check_now(t)  # raises, or an int time as a float
            if self._paused or not self._runs:  # nothing to read
                self._now = self._settled = t
            else:
                self._advance(t)
        return self._generated - self._consumed

    def buffer_seconds_at(self, t: float) -> float:
        """Buffer in seconds of reading at the current rate; 0.0 for an unpaced reader."""
        rate = self._rate
        if t != self._settled or type(t) is not float:  # else read off without the call: every stream, every step
            self.buffer_at(t)
        return (self._generated - self._consumed) / rate if rate > 0 else 0.0

    def stall_time_at(self, t: float) -> float:
        """Total stall seconds up to t, including a wait still going on at t (unless finished)."""
        t = self._check_now(t)
        self._advance(t)
        ongoing = t - self._ready if self._waiting(t) else 0.0
        return self._stall + ongoing

    def shifted(self, dt: float) -> None:
        """Move every stored time by dt: the model carried to another clock (a stream migrated to another
        replica, whose monotonic clock has a different origin). The buffer and the stall so far are unchanged."""
        check_time(dt, "dt")
        self._settled = None
        self._runs = deque((t + dt, n) for t, n in self._runs)
        self._ready = None if self._ready is None else self._ready + dt
        self._first = None if self._first is None else self._first + dt
        self._now += dt

    # ---- internals --------------------------------------------------------------------------------
    def _check_now(self, t: float) -> float:
        if type(t) is float and -_INF < t < _INF and t >= self._now:  # the common case, without check_time's call
            return t
        t = check_time(t)
        if t < self._now:
            raise ValueError(
                f"t={t} is earlier than the latest time seen ({self._now}); time must not go back"
            )
        return t

    def _advance(self, t: float) -> None:
        """Perform every read due at or before t under the current model."""
        self._now = t
        if self._paused or not self._runs:
            self._settled = t
            return
        if self._rate == 0:  # unpaced: everything generated is read at once
            self._consumed = self._generated
            self._runs.clear()
            self._settled = t
            return
        # Per stream per step: state in locals, written back once; max() and min() as the comparisons they make.
        runs, rate, ready = self._runs, self._rate, self._ready
        period = 1.0 / rate
        while runs:
            gen_t, count = runs[0]
            start = gen_t if gen_t > ready else ready  # max(ready, gen_t)
            if start > t:
                self._settled = t  # the next read is after t: another call at t finds the same and stops here
                break
            late = gen_t - ready
            if late > 0.0:
                self._stall += late
            # A run of one token is one read: t >= start makes the floor below at least 0.
            reads = 1 if count == 1 else min(count, math.floor((t - start) * rate + _READ_EPS) + 1)
            self._consumed += reads
            ready = start + reads * period
            if reads < count:
                runs[0] = (gen_t, count - reads)
                break  # not settled: a call at t again checks that the next read is after t (rounding)
            runs.popleft()
        else:
            self._settled = t
        self._ready = ready

    def _waiting(self, t: float) -> bool:
        """The reader is ready for a token that is not there (an ongoing stall) at t."""
        return (
            self._ready is not None
            and self._rate > 0
            and not self._paused
            and not self._finished
            and not self._runs
            and self._ready < t
        )

    def _bank_wait(self, t: float) -> None:
        # Before the model changes (new tokens, a report), the wait so far becomes stall history.
        if self._waiting(t):
            self._stall += t - self._ready
            self._ready = t

    def _set_rate(self, t: float, new_rate: float) -> None:
        old = self._rate
        self._rate = new_rate
        if self._ready is None:
            return
        if old > 0 and new_rate > 0:
            # The read in progress keeps its progress: the time left scales with old/new.
            if self._paused:
                self._pause_left *= old / new_rate
            elif self._ready > t:
                self._ready = t + (self._ready - t) * old / new_rate
        elif old == 0:
            self._pause_left = 0.0
            self._ready = max(self._ready, t)

    def _set_consumed(self, t: float, consumed: int) -> None:
        if self._generated == 0:
            return  # consumed must be 0: the reader has not started, nothing to replace
        self._consumed = consumed
        unread = self._generated - consumed
        # Unread tokens all came at or before t and the next read is after t, so their times no longer matter.
        self._runs = deque([(t, unread)] if unread else [])
        gap = 1.0 / self._rate if self._rate > 0 else 0.0
        if self._paused:
            self._pause_left = gap
        else:
            self._ready = t + gap

    def _set_paused(self, t: float, paused: bool) -> None:
        if paused:
            self._pause_left = max(0.0, self._ready - t) if self._ready is not None else 0.0
        elif self._ready is not None:
            self._ready = t + self._pause_left
        self._paused = paused
