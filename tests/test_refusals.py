"""tests/refusals.py: refusals run in a child process, and a child that crashes fails the test
naming the signal and the statement it was at (the native kernels' tests rely on it)."""

from __future__ import annotations

import pytest

from refusals import refused_in_child


def test_each_refusal_is_matched_against_its_message():
    refused_in_child("import math", [("math.sqrt(-1)", "math domain error"), ("int('x')", "invalid literal")],
                     error="ValueError")
    with pytest.raises(AssertionError, match=r"int\('7'\): raised None"):
        refused_in_child("", [("int('7')", "anything")], error="ValueError")
    with pytest.raises(AssertionError, match="does not match"):
        refused_in_child("", [("int('x')", "something else")], error="ValueError")


def test_a_crash_names_the_signal_and_the_statement():
    crash = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"
    with pytest.raises(pytest.fail.Exception, match=r"killed by SIGSEGV at 'crash\(\)'"):
        refused_in_child(f"def crash():\n    {crash.replace(chr(10), chr(10) + '    ')}",
                         [("int('x')", "invalid literal"), ("crash()", "never")], error="ValueError")
    with pytest.raises(pytest.fail.Exception, match="exited with status 3 at its set-up"):
        refused_in_child("raise SystemExit(3)", [("int('x')", "invalid literal")], error="ValueError")
