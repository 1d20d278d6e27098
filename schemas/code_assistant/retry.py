# file: retry.py
"""Retry a flaky call with exponential backoff and jitter."""

import functools
import logging
import random
import time

log = logging.getLogger(__name__)


def retry(attempts: int = 5, base: float = 0.5, cap: float = 30.0, on=(ConnectionError, TimeoutError)):
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for attempt in range(attempts):
                try:
                    return fn(*args, **kwargs)
                except on as e:
                    if attempt == attempts - 1:
                        raise
                    delay = random.uniform(0, min(cap, base * 2**attempt))
                    log.warning("%s failed (%s); retry %d in %.2fs", fn.__name__, e, attempt + 1, delay)
                    time.sleep(delay)

        return wrapper

    return decorate
