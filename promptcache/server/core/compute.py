"""``ComputeThread``: the one thread of a serving process that runs torch work.

Why one thread. torch's CPU kernels run their parallel regions on an OpenMP team, and GNU
OpenMP (libgomp, which the PyPI CPU builds of torch use) keeps one team per thread that starts
parallel regions. Once the process holds more OpenMP threads than it has cores (a team for the
main thread that loaded the model, and another for the engine thread that serves it), libgomp
stops spinning between regions and puts its workers to sleep, so every parallel region pays a
wake-up, and a decode step run on a thread other than the one that loaded the model was about a
third slower (measured: eval/results/design_figures.md). So the server loads the model, encodes schemas and
documents, checks the paged attention and runs every engine step on this one thread; the event
loop's thread only parses requests and streams answers (no parallel torch work).

    compute = ComputeThread()
    pc = compute.call(load_engine, ...)     # runs there, returns or raises here
    done = compute.start(loop_forever)       # a long task; ``done`` is its Future

Nothing is lost by it: torch work of one model is serialized by the runner's lock anyway.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

__all__ = ["ComputeThread"]

T = TypeVar("T")


class ComputeThread:
    """Runs callables on one daemon thread, in submission order. ``call`` from any other thread
    blocks for the result (an exception is raised in the caller, with its type); ``start``
    returns a Future. A call made on the compute thread itself runs inline (no deadlock). A
    daemon thread: a process that exits does not wait for it (the server drains it first)."""

    def __init__(self, name: str = "promptcache-engine"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int:
        """The thread's ``threading.get_ident()``."""
        return self._thread.ident

    def on_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        if self.on_thread():
            return fn(*args, **kwargs)
        return self.start(fn, *args, **kwargs).result()

    def start(self, fn: Callable[..., T], *args, **kwargs) -> Future:
        """``fn`` queued on the thread; calls queued later wait until it returns (a serving loop
        runs until it is told to stop, so work it needs goes before it)."""
        fut: Future = Future()
        self._tasks.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self) -> None:
        """The thread ends after what is queued before this."""
        self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            fut, fn, args, kwargs = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, with its type
                fut.set_exception(e)
