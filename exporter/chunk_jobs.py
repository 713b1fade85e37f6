"""Export chunks side by side, one worker process per chunk.

Lowering is single-threaded Python (graph passes over every node), so a machine's cores sit idle
while one chunk lowers; the chunks are independent. Workers are forked once the model is loaded
(its weights are shared copy-on-write, not copied or reloaded). One worker per chunk, even beyond
the cores, so the work is spread evenly: three equal chunks on two cores end together at 1.5
chunk-times (tiny model: 49 s), where two workers would take two (56 s). When memory allows fewer
workers, each takes the next chunk when it finishes one, keeping its own lowering cache warm.
Each worker returns the chunk's manifest entry and writes its files into the export's temporary
folder, so what is written is the same as exporting one chunk after another."""
from __future__ import annotations

import os
import signal
import threading
import traceback

from .errors import ExportError

# A worker's working set on top of the shared model: the traced and lowered graphs (a few hundred
# MiB) plus copies of the chunk's weights made while lowering; see default_jobs.
WORKER_BASE_BYTES = 512 * 2**20
WORKER_WEIGHT_COPIES = 3
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _available_memory_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_jobs(n_chunks: int, chunk_weight_bytes: int) -> int:
    """As many workers as there are chunks and memory for; 1 (in this process) where
    forking is not safe: other Python threads may hold locks a forked child would inherit held
    (tqdm's monitor, started by transformers' loaders, only sleeps and is left out)."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.name != "tqdm_monitor"]
    if others or not hasattr(os, "fork"):
        return 1
    jobs = n_chunks
    mem = _available_memory_bytes()
    if mem is not None:
        jobs = min(jobs, max(1, mem // (WORKER_BASE_BYTES + WORKER_WEIGHT_COPIES * chunk_weight_bytes)))
    return max(1, jobs)


def run_chunk_jobs(n: int, work, jobs: int, say) -> list:
    """[work(k, say) for k in range(n)], with up to `jobs` forked workers; `work`'s results must
    pickle. A worker's exception is raised here (the first one, by chunk); a worker that dies
    (killed, out of memory) is an ExportError naming its chunk."""
    if jobs <= 1 or n <= 1:
        return [work(k, say) for k in range(n)]
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("fork")
    threads = max(1, available_cpus() // jobs)
    workers = []
    # The stop signals are held across each fork: a child stopped before it set its own handlers
    # would otherwise run the parent's (zl-export's SIGTERM raises KeyboardInterrupt), and an
    # exception raised just after fork() returns unwinds the child up through the parent's code
    # (under pytest-xdist it finished the worker's session: "gw1 received keyboard-interrupt").
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        for _ in range(min(jobs, n)):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(there, work, threads, held), daemon=True)
            p.start()
            there.close()
            workers.append([p, here, None])  # process, connection, chunk it is on
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    results: dict[int, object] = {}
    pending = list(range(n))
    finished = False
    try:
        for w in workers:
            _assign(w, pending)
        while len(results) < n:
            ready = wait([w[1] for w in workers if w[2] is not None] + [w[0].sentinel for w in workers if w[2] is not None])
            for w in workers:
                p, conn, k = w
                if k is None:
                    continue
                if conn in ready or conn.poll():
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):  # its end closed, or reset with bytes unread
                        kind, value = "died", None
                    if kind == "say":
                        say(value)
                        continue
                    if kind == "error":
                        raise value
                    if kind == "died":
                        raise _died(k, p)
                    results[k] = value
                    _assign(w, pending)
                elif p.sentinel in ready:
                    raise _died(k, p)
        finished = True
        return [results[k] for k in range(n)]
    finally:
        for p, conn, _ in workers:
            if finished:
                conn.send(None)  # no more chunks: the worker returns
            else:
                p.terminate()  # a failure or Ctrl-C: what the others are doing is not needed
            conn.close()
        for p, _, _ in workers:
            p.join(timeout=None if finished else 10)
            if p.is_alive():  # deaf to SIGTERM (a handler it inherited) and to EOF (a sibling holds its pipe)
                p.kill()
                p.join()


def _assign(w, pending: list) -> None:
    w[2] = pending.pop(0) if pending else None
    if w[2] is not None:
        try:
            w[1].send(w[2])
        except OSError:  # it died before taking work (killed as it started): name it, not the pipe
            raise _died(w[2], w[0]) from None


def _died(k: int, p) -> ExportError:
    p.join(timeout=1)
    return ExportError(f"chunk {k}: its export worker died (exit code {p.exitcode}; out of memory?): "
                       "run again with --jobs 1 to export one chunk at a time")


def _worker(conn, work, threads: int, mask) -> None:
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which ends the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a SIGTERM held since the fork ends it here
    torch.set_num_threads(threads)
    while True:
        try:
            k = conn.recv()
        except EOFError:
            return
        if k is None:
            return
        try:
            conn.send(("done", work(k, lambda msg: conn.send(("say", msg)))))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
            if not isinstance(e, ExportError):  # a bug: keep where it happened
                e.add_note("in the export worker:\n" + "".join(traceback.format_exception(e)).rstrip())
            conn.send(("error", _picklable(e)))
            return


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError("".join(traceback.format_exception(e)).rstrip())
