"""zl-host eval's progress: loading a base model and scoring the held-out set twice takes minutes
on a real model, so it is shown, not waited through in silence. A bar on a terminal; on a log
(not a terminal) a line when each pass starts, at each quarter, and at the end."""
from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def evaluate_both(base: str, adapter, held_out: list, base_weights: str, console: Console) -> tuple[dict, dict]:
    """(base model's metrics, the adapter's) on the held-out micro-batches, with progress on `console`."""
    from .evaluate import evaluate

    with _progress(console) as track:
        before = evaluate(base, None, held_out, base_weights, progress=track("base model"))
        after = evaluate(base, adapter, held_out, base_weights, progress=track("with adapter"))
    return before, after


@contextmanager
def _progress(console: Console):
    if console.is_terminal:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("micro-batches"), TimeElapsedColumn(), console=console, transient=True) as bar:
            def track(name: str):
                task = bar.add_task(f"eval: {name} (loading)", total=None)

                def step(done: int, total: int) -> None:
                    bar.update(task, description=f"eval: {name}", completed=done, total=total)
                return step
            yield track
        return

    def track(name: str):
        t0, said = time.monotonic(), set()
        console.print(f"eval: {name}: loading the model", markup=False)

        def step(done: int, total: int) -> None:
            quarter = 4 * done // max(total, 1)
            if quarter not in said:
                said.add(quarter)
                console.print(f"eval: {name}: {done}/{total} micro-batches ({time.monotonic() - t0:.0f} s)", markup=False)
        return step
    yield track


@contextmanager
def working(console: Console, what: str):
    """A spinner on a terminal, a line on a log, for a step without a count."""
    if console.is_terminal:
        with console.status(what):
            yield
    else:
        console.print(what, markup=False)
        yield
