"""A seeded generator of hostile HTTP requests for the server fuzz test (``test_fuzz_http.py``).

``cases(seed, n)`` yields ``Case(method, path, headers, body)``: well-formed HTTP carrying bodies
and headers a careless or hostile client sends: valid requests with one to three fields replaced
by hostile values, random JSON, broken bytes, deep nesting, hostile PML, wrong content types,
foreign Host names, bad keys, unknown routes. Generated bodies keep ``max_tokens`` small or
invalid so the cases that are served cost a few decode steps each.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

HUGE_INTS = [2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**40, -(10**40)]
VALUES = [None, True, False, 0, -1, 1, 2, 0.5, -0.0, 1e308, -1e308, 3.75, "", "x", "é" * 7, "\u0000", "\ufffd",
          "<prompt/>", [], {}, [1, 2], ["a"], {"a": 1}, [[[[]]]], "9" * 40, "null", " " * 100,
          "\U0001F600" * 5, "\\u0000", '"', "a" * 5000, *HUGE_INTS]
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
          "n", "stream", "stream_options", "pml", "documents", "recompute", "prompt", "user", "logit_bias"]
PML = ['<prompt schema="travel"><trip days="3" travelers="two"/><tokyo/><user>Food?</user></prompt>',
       '<prompt schema="travel"><paris/><tokyo/></prompt>', '<prompt schema="nope"/>', '<prompt', "<a>" * 3000,
       '<prompt schema="travel"><trip days="' + "9" * 3000 + '"/></prompt>', '<!DOCTYPE x [<!ENTITY a "b">]><x/>',
       '<prompt schema="travel"><user>' + "<b>" * 500 + "</user></prompt>", "plain text", "\x00<prompt/>",
       '<prompt schema="travel"><trip days="3" days="4"/></prompt>', "<prompt schema='travel'>&bogus;</prompt>"]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                 "application/jsonx", "", "application/json;;", "*/*"]
HOSTS = ["127.0.0.1", "localhost", "LOCALHOST:1", "[::1]:8000", "evil.example", "127.0.0.1.evil.example", "",
         "localhost.", "a" * 300, "127.0.0.2"]
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/", "/v1/embeddings",
         "/v1/chat/completions/", "/v1//completions", "/%00", "/v1/chat/completions?x=1", "/" + "a" * 2000]


@dataclass
class Case:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None


def cases(seed: int, n: int, model: str):
    rng = random.Random(seed)
    makers = [(_mutated, 45), (_random_json, 12), (_broken_bytes, 8), (_deep, 6), (_pml, 10), (_headers, 12),
              (_route, 7)]
    kinds, weights = zip(*makers)
    for _ in range(n):
        yield rng.choices(kinds, weights)[0](rng, model)


def _json_case(body, path="/v1/chat/completions") -> Case:
    return Case("POST", path, {"content-type": "application/json", "host": "127.0.0.1"},
                json.dumps(body, allow_nan=True).encode())


def _base(rng: random.Random, model: str) -> tuple[dict, str]:
    if rng.random() < 0.6:
        return ({"model": model, "messages": [{"role": "user", "content": "Plan a day."}], "max_tokens": 2,
                 "temperature": 0}, "/v1/chat/completions")
    return {"model": model, "prompt": "Once upon", "max_tokens": 2}, "/v1/completions"


def _value(rng: random.Random):
    v = rng.choice(VALUES)
    if rng.random() < 0.15:
        return _random_tree(rng, 3)
    return v


def _mutated(rng: random.Random, model: str) -> Case:
    body, path = _base(rng, model)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.45:
            field = rng.choice(FIELDS)
            v = _value(rng)
            body[field] = 2 if field in ("max_tokens", "max_completion_tokens") and v is None else v
        elif op < 0.55:
            body.pop(rng.choice([f for f in FIELDS if not f.startswith("max_")]), None)
        elif op < 0.85 and isinstance(body.get("messages"), list):
            msg = {"role": rng.choice(["user", "system", "assistant", "developer", "tool", "", None, 3]),
                   "content": rng.choice([_value(rng), "hi", [{"type": "text", "text": "hi"}],
                                          [{"type": rng.choice(["text", "image_url", 7]), "text": _value(rng)}]])}
            if rng.random() < 0.2:
                msg = _value(rng)
            body["messages"].insert(rng.randint(0, len(body["messages"])), msg)
        else:
            body["prompt"] = rng.choice([[rng.randint(-5, 200000) for _ in range(rng.randint(0, 8))],
                                         ["a", "b"], [[1, 2]], "hi", [], _value(rng)])
    return _json_case(body, path)


def _random_tree(rng: random.Random, depth: int):
    r = rng.random()
    if depth <= 0 or r < 0.4:
        return rng.choice(VALUES[:28])
    if r < 0.7:
        return [_random_tree(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS + ["role", "content", "x"]): _random_tree(rng, depth - 1) for _ in range(rng.randint(0, 4))}


def _random_json(rng: random.Random, model: str) -> Case:
    return _json_case(_random_tree(rng, 5), rng.choice(PATHS[:2]))


def _broken_bytes(rng: random.Random, model: str) -> Case:
    good = json.dumps(_base(rng, model)[0]).encode()
    choice = rng.randint(0, 5)
    if choice == 0:
        body = good[:rng.randint(0, len(good) - 1)]  # truncated
    elif choice == 1:
        body = bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 200)))
    elif choice == 2:
        body = good.replace(b"Plan", b"\xff\xfe").replace(b"Once", b"\xc3\x28")  # invalid UTF-8
    elif choice == 3:
        body = good.replace(b'"max_tokens": 2', b'"max_tokens": ' + b"9" * rng.choice([20, 5000]))
    elif choice == 4:
        body = good.replace(b"0", b"NaN").replace(b"2", b"Infinity")
    else:
        body = b"\xef\xbb\xbf" + good  # a UTF-8 BOM
    return Case("POST", rng.choice(PATHS[:2]), {"content-type": "application/json", "host": "127.0.0.1"}, body)


def _deep(rng: random.Random, model: str) -> Case:
    depth = rng.choice([10, 31, 33, 100, 1000, 5000, 50000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    inner = opener * depth + "1" + closer * depth
    body, path = _base(rng, model)
    text = json.dumps(body).replace('"max_tokens": 2', '"max_tokens": 2, "x": ' + inner)
    if rng.random() < 0.3:
        text = inner
    return Case("POST", path, {"content-type": "application/json", "host": "127.0.0.1"}, text.encode())


def _pml(rng: random.Random, model: str) -> Case:
    body, path = _base(rng, model)
    body["pml"] = rng.choice(PML)
    if path.endswith("chat/completions"):
        body["messages"] = []
    else:
        body["prompt"] = ""
    if rng.random() < 0.3:
        body["recompute"] = rng.choice([0.5, 1.0, -1, 2, "x"])
    return _json_case(body, path)


def _headers(rng: random.Random, model: str) -> Case:
    case = _json_case(*_base(rng, model))
    case.headers["content-type"] = rng.choice(CONTENT_TYPES)
    case.headers["host"] = rng.choice(HOSTS)
    if rng.random() < 0.4:
        case.headers["authorization"] = rng.choice(["Bearer", "Bearer x", "Basic eA==", "bearer  ", "x" * 500])
    if rng.random() < 0.3:
        case.headers["origin"] = rng.choice(["https://evil.example", "null", "http://127.0.0.1"])
    if not case.headers["content-type"]:
        del case.headers["content-type"]
    return case


def _route(rng: random.Random, model: str) -> Case:
    method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    body = json.dumps(_base(rng, model)[0]).encode() if method in ("POST", "PUT", "PATCH") else None
    return Case(method, rng.choice(PATHS), {"content-type": "application/json", "host": "localhost"}, body)
