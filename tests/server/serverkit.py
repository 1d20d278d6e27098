"""Helpers of the server tests: real uvicorn servers on free ports, clients, raw HTTP, metrics.

Servers run in a thread of the test process (uvicorn on 127.0.0.1) so tests can reach the
engine they serve; ``test_serve_cli.py`` starts the command in a subprocess. (A module of its
own, not conftest.py: ``from conftest import`` would be ambiguous beside tests/conftest.py.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import openai
import uvicorn

ROOT = Path(__file__).resolve().parents[2]
MODEL = "embedded"
BLOCK = 16  # tokens per prefix block in these tests (small prompts still span several blocks)


# a Hermes-style (Qwen2.5-like) chat template with tools, in the embedded tokenizer's roles
HERMES_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|system|>
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Their signatures are within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each call, return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|end|>
{% elif messages[0].role == 'system' %}<|system|>
{{ messages[0].content }}<|end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'assistant' %}<|assistant|>
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- set f = call.function if call.function is defined else call %}
{%- if loop.first and not m.content %}{% else %}{{ '\\n' }}{% endif %}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}
</tool_call>
{%- endfor %}<|end|>
{% elif m.role == 'tool' %}<|user|>
<tool_response>
{{ m.content }}
</tool_response><|end|>
{% else %}<|{{ m.role }}|>
{{ m.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_until(args: list[str], marker: str, timeout: float = 120.0, cwd=None) -> tuple[subprocess.Popen, list[str]]:
    """Start ``python args...`` (this checkout importable) and read its stderr until a line holds
    ``marker``. Returns (process, the lines read); fails with those lines if it exits first or
    ``timeout`` seconds pass, and then kills it."""
    proc = subprocess.Popen([sys.executable, *args], stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    log: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while not any(marker in line for line in log):
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "".join(log)
            log.append(line)
            assert time.monotonic() < deadline, "".join(log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, log


@contextmanager
def running(app):
    """Serve ``app`` on a free port; yields its base URL ('http://127.0.0.1:PORT')."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def http(method: str, url: str, body: dict | None = None, key: str | None = None):
    """(status, content type, body text) of a raw request (stdlib only)."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode()


def metric(url: str, name: str, **labels) -> float:
    """A sample's value from the server's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http("GET", url + "/metrics")[2]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0
