"""Run a command on a pseudo-terminal (stdin, stdout and stderr all a TTY) and collect its output."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time


def run_on_pty(args: list[str], lines: list[str] = (), wait_for: str | None = None, timeout: float = 600,
               env: dict | None = None, cwd=None) -> str:
    """Start ``args`` on a pty; each of ``lines`` is typed after ``wait_for`` appears (again); the
    output (with the terminal's carriage returns) is returned when the process ends."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 24x100 terminal, as a user's
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True)
    os.close(slave)
    out, pending, seen = b"", list(lines), 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            text = out.decode("utf-8", "replace")
            if pending and wait_for is not None and text.count(wait_for) > seen:
                seen = text.count(wait_for)
                os.write(master, (pending.pop(0) + "\n").encode())
            elif not pending and wait_for is not None and text.count(wait_for) > seen and lines:
                os.write(master, b"\x04")  # Ctrl-D: end of input
                seen = text.count(wait_for)
            if proc.poll() is not None and not ready:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    return out.decode("utf-8", "replace")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "promptcache", *args]
