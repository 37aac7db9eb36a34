"""The C++ wrappers of a compile ahead built in the background.

Compiling a region graph with a C++ wrapper (`runner.counting_backend`) ends in g++ building one file, 3-5 s a
graph on a 2-core CPU, while tracing and lowering the next graph takes Python 1-7 s: done one after the other, as
dynamo does, a cold compile of the mid-size config's 6 graphs took 48 s. A compile ahead (`RegionDecoder.
compile_ahead`: a step on fresh caches whose outputs are thrown away) hands each wrapper's build (its precompiled
header, g++, loading the module: inductor's `CppWrapperCodeCache.load_pybinding`) to two worker threads and goes
on: a graph whose build has not finished runs as traced (its FX graph, eagerly), so the next one can be traced
from its outputs. `wait` ends the builds; a real step then runs the built graphs only. A run's steps never take
the traced graphs (their rounding may differ from the compiled code's in the last bit): they run after `wait`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from unittest import mock

# two builds at once: g++ is single-threaded, and on a 2-core CPU the main thread's tracing takes the rest
WORKERS = 2


class Builds:
    """Wrapper builds submitted while graphs compile (`submitting`), each graph's kept apart (`built`)."""

    def __init__(self, workers: int = WORKERS):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="mhcrun-build")
        self.futures: list[Future] = []  # every build submitted, in order

    @contextlib.contextmanager
    def submitting(self) -> Iterator[list[Future]]:
        """While a graph compiles: its wrapper's build goes to the pool (the list yielded gets its futures) and
        the module's entry point waits for it when called."""
        from torch._inductor.codecache import CppWrapperCodeCache

        load = CppWrapperCodeCache.load_pybinding  # bound to the class: the synchronous build, run in a worker
        mine: list[Future] = []

        def load_later(cls, *args, **kwargs) -> Callable:
            future = self.pool.submit(load, *args, **kwargs)
            mine.append(future)
            self.futures.append(future)
            return lambda *a: future.result()(*a)

        with mock.patch.object(CppWrapperCodeCache, "load_pybinding", classmethod(load_later)):
            yield mine

    def wait(self) -> None:
        """Every build finished (a failed one's error is its future's: `failure`)."""
        for f in self.futures:
            f.exception()
        self.pool.shutdown()


def built(compiled: Callable, traced: Callable, futures: list[Future]) -> Callable:
    """The graph's compiled function once its builds finished, its traced graph (eager) until then or where one
    failed (`failure` says why)."""
    ready = False

    def run(*args):
        nonlocal ready
        if not ready:
            if not all(f.done() for f in futures) or failure(futures) is not None:
                return traced(*args)
            ready = True
        return compiled(*args)

    return run


def failure(futures: list[Future]) -> BaseException | None:
    """The first failed build's error, of those finished."""
    return next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
