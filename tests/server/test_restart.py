"""A `promptcache serve` replica restarted on its --spill-dir serves from it: the first repeated
request reports cached tokens (official openai client), the same answer, states the codec
verifies, and the folder within --disk-budget."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from serverkit import client, free_port, start_until

from promptcache.store import codec
from promptcache.store.spillfolder import SUFFIX

BUDGET = 400_000  # bytes of --disk-budget: a few of the embedded model's 16-token blocks
MESSAGES = [{"role": "system", "content": "You are a terse travel agent who knows every city in Europe well. " * 3},
            {"role": "user", "content": "Plan three days in Lisbon with food, museums and a day trip."}]


def serve(folder, port: int, *more: str) -> subprocess.Popen:
    args = ["-m", "promptcache.server", "--model", "embedded", "--port", str(port),
            "--block-size", "16", "--spill-dir", str(folder), "--disk-budget", str(BUDGET), "--host-budget", "214748",
            *more]
    return start_until(args, "Ready")[0]


def ask(port: int):
    oai = client(f"http://127.0.0.1:{port}")
    for _ in range(100):  # uvicorn binds right after "Ready"
        try:
            return oai.chat.completions.create(model="embedded", messages=MESSAGES, max_tokens=4, temperature=0)
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.1)
    raise AssertionError("the server never answered")


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), err  # uvicorn re-raises SIGTERM once it has shut down
    return err


def folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.glob("*" + SUFFIX))


@pytest.mark.slow  # two subprocesses load torch (~25 s each on a busy 2-core machine)
def test_a_restarted_replica_serves_from_its_spill_folder(tmp_path):
    folder, port = tmp_path / "spill", free_port()
    proc = serve(folder, port)
    try:
        first = ask(port)
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # a fresh folder
        err = stop(proc)
        assert "persisted" in err, err  # the app's shutdown wrote what memory held
        assert 0 < folder_bytes(folder) <= BUDGET
        for f in folder.glob("*" + SUFFIX):  # every file is a state the codec verifies under its name
            states = codec.StatesFile(f)
            states.read("kv", codec.StateInfo(f.name[: -len(SUFFIX)]))
        proc = serve(folder, port)
        again = ask(port)
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # was 0 before the folder was indexed
        assert again.choices[0].message.content == first.choices[0].message.content
        stop(proc)
        assert folder_bytes(folder) <= BUDGET
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # two subprocesses load torch
def test_a_replica_killed_with_sigkill_serves_what_it_wrote_behind(tmp_path):
    """The default disk policy with a spill folder writes new blocks behind the requests (within
    --disk-lag seconds), so a SIGKILL loses no more than those: a restart serves the prompt's
    blocks as a graceful one would (>= 90% of the cached tokens the same server reported before)."""
    folder, port = tmp_path / "spill", free_port()
    proc = serve(folder, port, "--disk-lag", "0.5")
    try:
        ask(port)
        warm = ask(port).usage.prompt_tokens_details.cached_tokens  # what the running server reuses
        assert warm > 0
        deadline, seen = time.monotonic() + 20, -1
        while time.monotonic() < deadline:  # written behind: files appear within the lag
            time.sleep(0.5)
            n = len(list(folder.glob("*" + SUFFIX)))
            if n and n == seen:
                break
            seen = n
        proc.kill()  # SIGKILL: no shutdown runs, nothing is persisted at exit
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL
        for f in folder.glob("*" + SUFFIX):  # whole files only: each verifies under its name
            codec.StatesFile(f).read("kv", codec.StateInfo(f.name[: -len(SUFFIX)]))
        proc = serve(folder, port)
        again = ask(port)
        assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * warm
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
