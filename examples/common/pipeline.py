"""The training loop's input pipeline (batches made ahead, in a thread or worker
processes) and its step profiler."""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import pathlib
import queue
import threading
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from examples.common.trainer import Batch, Task


class Prefetch:
    """Produces the placed batches of steps start..stop-1, in order, from a background thread.

    With workers > 0 the thread keeps depth + workers steps in flight in that many worker
    processes (task.train_batch is pure in the step, so any process can make any step) and
    places each result: a data pipeline of pure Python would otherwise bound a fast GPU's
    steps by one CPU core.
    """

    def __init__(self, task: Task, start: int, stop: int, depth: int, workers: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._pool = (concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")) if workers else None)
        ahead = max(depth, 1) + workers

        def in_thread(steps):
            return (task.train_batch(step) for step in steps)

        def in_workers(steps):
            pending: collections.deque = collections.deque()
            for step in steps:
                pending.append(self._pool.submit(task.train_batch, step))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

        def put(item) -> None:
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    return
                except queue.Full:
                    pass

        def work():
            made = in_thread if self._pool is None else in_workers
            try:
                for batch in made(range(start, stop)):
                    if self._stop.is_set():
                        return
                    put(task.placed(batch))
            except Exception as error:  # the step waiting for this batch raises it
                put(error)

        self._thread = threading.Thread(target=work, daemon=True)
        self._thread.start()

    def next(self) -> Batch:
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class StepProfiler:
    """Traces steps [start, start + steps) with jax.profiler into `directory` (steps 0: off).

    Only the training steps: the trace stops when the last one has finished, before
    any logging, evaluation or checkpoint. It includes a Perfetto JSON
    (perfetto_trace.json.gz) that benchmarks/kernel_profile.py sums into device
    time per kernel kind.
    """

    def __init__(self, directory: pathlib.Path, start: int, steps: int):
        self.directory, self.start, self.end = directory, start, start + steps
        self.active = False

    def at_step(self, step: int) -> None:
        if step == self.start and self.end > self.start:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after_step(self, done: int) -> None:
        if done == self.end:
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.block_until_ready(jax.live_arrays())
            jax.profiler.stop_trace()
            self.active = False
