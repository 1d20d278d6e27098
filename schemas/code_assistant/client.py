# file: client.py
"""A weather API client that uses the cache, the rate limiter and retries."""

import json
import urllib.request

from lru_cache import LRUCache
from rate_limiter import TokenBucket
from retry import retry

_cache = LRUCache(capacity=256, ttl=600)
_bucket = TokenBucket(rate=5, burst=10)


@retry(attempts=3)
def _fetch(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def forecast(city: str) -> dict:
    cached = _cache.get(city)
    if cached is not None:
        return cached
    if not _bucket.try_acquire():
        raise RuntimeError("rate limit reached; try again shortly")
    data = _fetch(f"https://api.example.com/forecast?city={city}")
    _cache.put(city, data)
    return data
