# file: rate_limiter.py
"""Token-bucket rate limiting for outgoing API calls."""

import asyncio
import time


class TokenBucket:
    """Allows `rate` calls per second on average, with bursts of up to `burst` calls."""

    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.updated = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def try_acquire(self, n: int = 1) -> bool:
        self._refill()
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    async def acquire(self, n: int = 1) -> None:
        while not self.try_acquire(n):
            await asyncio.sleep((n - self.tokens) / self.rate)
