"""Library errors -> one line on stderr and an exit code; never a traceback for a user's mistake.

Exit codes: 0 ok; 1 bad input (PML, artifacts, settings, unknown model); 2 the environment
(no network, no CUDA, missing files or packages) -- and click's own usage errors (bad option,
``--dtype`` typo), which click also ends with 2; 130 interrupted (Ctrl-C, as shells report SIGINT). An error class may say its code itself with
an ``exit_code`` attribute (``promptcache.PromptCacheError`` subclasses do); it wins.
"""

from __future__ import annotations

import functools
import sys

import click

from ..errors import PromptCacheError

__all__ = ["EnvironmentProblem", "INTERRUPTED", "exit_code", "guard", "message"]

INTERRUPTED = 130  # 128 + SIGINT


class EnvironmentProblem(PromptCacheError, click.ClickException):
    """Something about this machine, found by the CLI itself (``--device cuda`` without CUDA)."""

    exit_code = 2


def _library_error(e: BaseException) -> bool:
    return hasattr(e, "exit_code") or type(e).__module__.startswith("promptcache") or isinstance(
        e, (ValueError, KeyError, OSError, ImportError))


def exit_code(e: BaseException) -> int:
    code = getattr(e, "exit_code", None)
    if isinstance(code, int):
        return code
    return 2 if isinstance(e, (OSError, ImportError)) else 1


def message(e: BaseException) -> str:
    """One line: ``error: ...`` (a PMLError keeps its ``file:line: reason`` form after the prefix)."""
    text = e.args[0] if isinstance(e, KeyError) and e.args else (getattr(e, "message", None) or str(e))
    text = " ".join(str(text).split()) or type(e).__name__
    return f"error: {text}"


def guard(fn):
    """Run a command; a library error prints ``message(e)`` and exits with ``exit_code(e)``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(INTERRUPTED)
        except (click.exceptions.Exit, click.exceptions.Abort, click.UsageError):
            raise
        except click.ClickException as e:
            click.echo(message(e), err=True)
            sys.exit(e.exit_code)
        except Exception as e:
            if not _library_error(e):
                raise
            click.echo(message(e), err=True)
            sys.exit(exit_code(e))

    return wrapper
