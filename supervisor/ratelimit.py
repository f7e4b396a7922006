"""One token bucket for every rate the supervisor holds a worker to.

A worker's output lines (output.LineLimiter), its status lines and status events
(lifecycle/_io.py) and its exec-watch requests (sandbox/execwatch.py) each cost the
supervisor work it does on the worker's behalf; each is bounded by a bucket of this
shape. The clock is passed in (monotonic seconds), as LineLimiter's is, so a test can
drive it without sleeping.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    """`rate` tokens a second, held up to `depth`.

    `tokens` is what it holds at its first look (None: full); it refills from then
    on. `take` is the polite form (take only what is there); `charge` takes whatever
    the cost was, into debt down to `floor`: for work already done, whose cost is
    only known after it (CPU), or a cost a worker must pay back before its next turn.
    """

    rate: float                  # tokens a second
    depth: float                 # tokens held at most
    tokens: float | None = None  # held at the last look (None: not looked at yet: full)
    at: float | None = None      # when it was last looked at

    def level(self, now: float) -> float:
        """The tokens held at `now`."""
        if self.at is None:
            self.tokens = self.depth if self.tokens is None else self.tokens
        else:
            self.tokens = min(self.depth, self.tokens + max(now - self.at, 0.0) * self.rate)
        self.at = now
        return self.tokens

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Take `cost` if it is held (True); else take nothing (False)."""
        if self.level(now) >= cost:
            self.tokens -= cost
            return True
        return False

    def charge(self, now: float, cost: float, *, floor: float = float("-inf")) -> float:
        """Take `cost` whether or not it is held, down to `floor`; the tokens left."""
        self.tokens = max(self.level(now) - cost, floor)
        return self.tokens
