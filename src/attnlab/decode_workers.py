"""Where `translate_lines` decodes its batches: in the calling thread, or on a CPU several at once.

On a CPU with N torch threads, N batches are decoded at once with one thread each, as CTranslate2's
`inter_threads` workers do: a decoding step's small matrices split poorly across threads. The workers are forked
processes where that is safe, else threads. A fork is safe on Linux, not from a daemonic process (which may have
no children), and only for workers of one torch thread: GNU OpenMP, which torch and MKL use, hangs a forked child
that opens a parallel region once the parent has had one (the child has the parent's pool but not its threads);
on one thread no region is opened.
- processes: each worker has its own interpreter, so one worker's Python (a third or more of a small batch's step)
  never waits for the other's; thread workers share the GIL for it, and on two threads the CPUs sat idle for part
  of a pass. A fork shares the module's weights (and their packed copies, models/prepack.py) with the parent page
  by page; only the batches' indices go to a worker and only token ids come back. Of N workers N - 1 are forked
  and the calling thread is the last: a forked worker's caches end with it, this process's stay, so what oneDNN
  compiles here for a packed linear's shapes (once per new row count) is there for the next call's forks.
- threads: torch releases the GIL inside its operators, so one thread's Python overlaps the other's kernels.
With fewer batches than threads each of the B workers gets N // B threads, so no core torch would use sits idle;
those are threads.
The translations are the same whichever runs them: each batch is decoded alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

PR_SET_PDEATHSIG = 1  # prctl(2)
# a worker's job, in a forked worker process (set by _start_worker, which the fork hands it without pickling)
_JOB: DecodeJob | None = None


@dataclass
class DecodeJob:
    """What a worker needs to decode a batch of `encoded` (token ids per line, EOS ended) given by line indices."""

    module: Any  # a Seq2SeqModule, in eval mode for the whole call
    encoded: list[list[int]]
    pad_id: int
    device: torch.device
    dtype: torch.dtype | None  # autocast dtype, None for none
    beam: int


def decode_batch(job: DecodeJob, idx: list[int]) -> list[list[int]]:
    """The best translation's ids (no BOS/EOS) of each line in idx, decoded as one padded batch."""
    width = max(len(job.encoded[i]) for i in idx)
    src = torch.full((len(idx), width), job.pad_id, dtype=torch.long)  # (n, S)
    for row, i in enumerate(idx):
        src[row, : len(job.encoded[i])] = torch.tensor(job.encoded[i])
    # autocast and no_grad are per thread: set in the thread that decodes
    with torch.no_grad(), torch.autocast(job.device.type, dtype=job.dtype, enabled=job.dtype is not None):
        return job.module.translate_ids(src.to(job.device), job.beam)


def _start_worker(job: DecodeJob, threads: int, parent: int) -> None:
    global _JOB
    # the kernel kills this worker when its parent's forking thread ends (a killed CLI, a test run timed out), so
    # that no orphan keeps decoding or holds the parent's output pipes open; Linux only, as the fork is
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the line above
        os._exit(1)
    _JOB = job
    torch.set_num_threads(threads)


def _decode_in_worker(idx: list[int]) -> list[list[int]]:
    assert _JOB is not None, "a decoding worker process runs _start_worker first"
    return decode_batch(_JOB, idx)


def can_fork() -> bool:
    """Whether workers may be forked processes: on Linux (macOS' system libraries are not safe to fork once
    used; Windows cannot fork) and not from a daemonic process (multiprocessing gives those no children)."""
    return (sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
            and not multiprocessing.current_process().daemon)


@contextlib.contextmanager
def batch_workers(job: DecodeJob, n_batches: int, workers: int | None = None,
                  processes: bool | None = None) -> Iterator[Callable[[list[list[int]]], Iterator[Any]]]:
    """A function mapping batches (lists of line indices) to their ids, in order, lazily. On a CPU with `workers`
    (default: torch's thread count N) > 1 and more than one batch: that many at once, in this thread and forked
    processes where `processes` (default: `can_fork()`) and each worker has one thread, else in threads (module
    docstring).
    Elsewhere, one batch at a time in this thread. This thread's torch thread count is the same after."""
    cpu = job.device.type == "cpu"
    n = torch.get_num_threads() if cpu else 1
    workers = min(workers or n, n_batches) if cpu else 1
    if workers < 2:
        yield functools.partial(map, functools.partial(decode_batch, job))
        return
    each = max(n // workers, 1)
    fork = each == 1 and (can_fork() if processes is None else processes)
    torch.set_num_threads(each)  # torch's thread count is per thread: this one's, and each worker's at its start
    try:
        if fork:
            # with fork the pool starts every worker at its first task, before its own thread (none is forked), and
            # hands `job` to _start_worker in memory; a worker that dies raises BrokenProcessPool here
            pool = ProcessPoolExecutor(workers - 1, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_start_worker, initargs=(job, each, os.getpid()))
            try:
                yield functools.partial(_shared, pool, workers - 1, job)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="attnlab-decode", initializer=torch.set_num_threads,
                                initargs=(each,)) as pool:
            yield functools.partial(pool.map, functools.partial(decode_batch, job))
    finally:
        torch.set_num_threads(n)


def _shared(pool: ProcessPoolExecutor, procs: int, job: DecodeJob, batches: list[list[int]]) -> Iterator[Any]:
    """The ids of each batch, in order, decoded by `pool`'s `procs` forked workers and this thread: each takes the
    next batch no one has taken when it finishes one (a worker's is handed out by its last one's done-callback).
    This thread decoding too keeps what oneDNN compiles for its shapes in this process, so that the next call's
    forks start with it (module docstring). An error is raised at its batch's turn; no batch is handed out after
    one."""
    lock = threading.Condition()
    done: dict[int, Future] = {}  # batch index -> its finished future (a worker's, or one for this thread's)
    taken, failed = 0, False

    def take() -> int | None:
        nonlocal taken
        with lock:
            if taken == len(batches) or failed:
                return None
            taken += 1
            return taken - 1

    def finished(i: int, f: Future) -> bool:
        nonlocal failed
        with lock:
            done[i] = f
            failed = failed or f.cancelled() or f.exception() is not None
            lock.notify_all()
            return not failed

    def hand_out() -> None:  # the next batch to a free worker
        i = take()
        if i is None:
            return
        try:
            pool.submit(_decode_in_worker, batches[i]).add_done_callback(
                lambda f, i=i: finished(i, f) and hand_out())
        except RuntimeError as e:  # the pool is shut down or broken: raised at this batch's turn
            finished(i, _future(error=e))

    for _ in range(procs):
        hand_out()
    for turn in range(len(batches)):
        while turn not in done:
            i = take()
            if i is None:  # every batch is taken: wait for this turn's
                with lock:
                    lock.wait_for(lambda turn=turn: turn in done)
                break
            try:
                finished(i, _future(result=decode_batch(job, batches[i])))
            except Exception as e:  # as a worker's error
                finished(i, _future(error=e))
        with lock:
            f = done.pop(turn)
        yield f.result()


def _future(result: Any = None, error: BaseException | None = None) -> Future:
    f: Future = Future()
    if error is None:
        f.set_result(result)
    else:
        f.set_exception(error)
    return f
