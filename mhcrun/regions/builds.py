"""The C++ wrappers of a compile ahead built in the background.

Compiling a region graph with a C++ wrapper (`runner.counting_backend`) ends in g++ building one file, 1-4 s a
graph on a 2-core CPU, while tracing and lowering the next graph takes Python 1-7 s: done one after the other, as
dynamo does, a cold compile of the mid-size config's 6 graphs took 48 s (when each build took 3-5 s). A compile
ahead (`RegionDecoder.compile_ahead`: a step on fresh caches whose outputs are thrown away) hands each wrapper's
build (its precompiled header, g++, loading the module: inductor's `CppWrapperCodeCache.load_pybinding`) to two
worker threads and goes on: a graph whose build has not finished runs as traced (its FX graph, eagerly), so the
next one can be traced from its outputs. The header's precompile (6 s, once a machine) starts with the compile, not
at the first graph's build. Leaving `Builds` (a context) ends the builds; the run's steps, which come after, run
the built graphs only, never the traced ones (whose rounding may differ from the compiled code's in the last bit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from unittest import mock

# a wrapper that does nothing, built with the graphs' flags and header (as inductor's generated wrappers start)
EMPTY_WRAPPER = """#include <torch/csrc/inductor/cpp_wrapper/cpu.h>
void inductor_entry_impl(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {}
"""

# two builds at once: g++ is single-threaded, and on a 2-core CPU the main thread's tracing takes the rest
WORKERS = 2


class Builds:
    """Wrapper builds submitted while graphs compile (`submitting`), each graph's kept apart (`built`)."""

    def __init__(self, config: dict, workers: int = WORKERS):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="mhcrun-build")
        self.config = config  # inductor's settings for the builds: its config patches hold for their own thread only
        self.futures: list[Future] = []  # every graph's build submitted, in order
        self.tasks: list[Future] = []  # every task submitted (the header's too)
        self.workers: set[int] = set()  # the worker threads' ids (`threading.get_native_id`)

    @contextlib.contextmanager
    def submitting(self) -> Iterator[list[Future]]:
        """While a graph compiles: its wrapper's build goes to the pool (the list yielded gets its futures) and
        the module's entry point waits for it when called."""
        from torch._inductor.codecache import CppWrapperCodeCache

        load = CppWrapperCodeCache.load_pybinding  # bound to the class: the synchronous build, run in a worker
        mine: list[Future] = []

        def load_later(cls, *args, **kwargs) -> Callable:
            future = self.submit(load, *args, **kwargs)
            mine.append(future)
            self.futures.append(future)
            return entry_of(future)

        with mock.patch.object(CppWrapperCodeCache, "load_pybinding", classmethod(load_later)):
            yield mine

    def start_header(self) -> None:
        """Start the header's precompile now (6 s, once a machine: `runner.wrapper_header`), by building an empty
        wrapper with the graphs' flags in a worker, rather than when the first graph is built, after its tracing
        and lowering: the first graph's build waits for it either way. Nothing lost where it fails (the first
        graph's build precompiles it then)."""
        from torch._inductor.codecache import CppWrapperCodeCache

        self.submit(CppWrapperCodeCache.load_pybinding, argtypes=["std::vector<AtenTensorHandle>"],
                    main_code=EMPTY_WRAPPER, device_type="cpu", needs_vec_isa=True, num_outputs=0)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """fn(*args, **kwargs) in a worker, under the builds' inductor settings."""

        def task():
            import torch._inductor.config

            self.workers.add(threading.get_native_id())
            with torch._inductor.config.patch(self.config):
                return fn(*args, **kwargs)

        self.tasks.append(self.pool.submit(task))
        return self.tasks[-1]

    def __enter__(self) -> Builds:
        self.start_header()
        return self

    def __exit__(self, kind, error, tb) -> None:
        """The compile ahead ended: every build finished (a failed one's error is its future's: `failure`), or,
        where it ended by an error (an interrupt), the builds stopped (`stop`)."""
        try:
            if kind is None:
                for f in self.futures:
                    f.exception()
                self.pool.shutdown()
                return
        except BaseException:  # interrupted while waiting
            self.stop()
            raise
        self.stop()

    def stop(self) -> None:
        """The builds not yet started dropped, and the compilers of those running ended until every task has
        (a build that waited for the header's precompile starts its own when that one ends): an interrupted run
        leaves at once, not when the header's precompile is done."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        while not all(f.done() for f in self.tasks):
            for tid in self.workers:
                end_children(f"/proc/self/task/{tid}/children")
            time.sleep(0.05)


def end_children(listing: str) -> None:
    """SIGKILL to the processes a /proc `children` file lists, and to theirs (g++'s cc1plus), where Linux lists
    them."""
    try:
        pids = Path(listing).read_text().split()
    except OSError:
        return
    for pid in pids:
        for sub in Path(f"/proc/{pid}/task").glob("*/children"):
            end_children(str(sub))
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)


def entry_of(future: Future) -> Callable:
    """A module's entry point that waits for its build at the first call, and then calls it directly (a region
    call of every decode step goes through it: no lock taken again)."""
    fn = None

    def entry(*args):
        nonlocal fn
        if fn is None:
            fn = future.result()
        return fn(*args)

    return entry


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
