"""Chunks exported side by side in forked workers (exporter/chunk_jobs.py): the same export as
one chunk after another, a worker's failure raised in the parent with nothing left behind."""
import json
import multiprocessing
import os
import signal

import pytest

from exporter import chunk_jobs
from exporter import export as export_mod
from exporter.errors import ExportError

from .conftest import small_export_config


def _files(out):
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def _manifest_without_timings(out):
    m = json.loads((out / "manifest.json").read_text())
    for c in m["chunks"]:
        c.pop("export_seconds")
    return m


def test_parallel_export_writes_what_a_serial_one_does(small_model_dir, tmp_path):
    cfg = small_export_config()  # portable: no lowering cache, so every byte must agree
    said = []
    export_mod.export_model(str(small_model_dir), "0-0,1-1,2-2", tmp_path / "serial", cfg, jobs=1)
    _, artifacts = export_mod.export_model(str(small_model_dir), "0-0,1-1,2-2", tmp_path / "parallel", cfg,
                                           jobs=3, progress=said.append, modes=("zerolock", "bp"))
    export_mod.export_model(str(small_model_dir), "0-0,1-1,2-2", tmp_path / "serial_both", cfg, jobs=1,
                            modes=("zerolock", "bp"))
    assert "exporting 3 chunks, 3 at a time" in said
    assert [m for m in said if m.endswith("tracing")] != []  # the workers' progress reaches the parent
    assert _files(tmp_path / "parallel") == _files(tmp_path / "serial_both")
    assert _manifest_without_timings(tmp_path / "parallel") == _manifest_without_timings(tmp_path / "serial_both")
    assert set(_files(tmp_path / "serial")) < set(_files(tmp_path / "parallel"))
    assert [a.chunk is not None and a.bp_chunk is not None for a in artifacts] == [True] * 3  # for --verify
    assert multiprocessing.active_children() == []


def _fail_in_chunk(monkeypatch, k_failing: int, action):
    original = export_mod._export_chunk

    def export_chunk(k, *args, **kw):
        if k == k_failing:
            action()
        return original(k, *args, **kw)

    monkeypatch.setattr(export_mod, "_export_chunk", export_chunk)  # the forked workers inherit it


def test_an_export_error_in_a_worker_is_the_exports_error(small_model_dir, tmp_path, monkeypatch):
    def refuse():
        raise ExportError("chunk 1 cannot be exported: a reason")

    _fail_in_chunk(monkeypatch, 1, refuse)
    with pytest.raises(ExportError, match="chunk 1 cannot be exported: a reason"):
        export_mod.export_model(str(small_model_dir), "0-0,1-1,2-2", tmp_path / "o", small_export_config(), jobs=3)
    assert list(tmp_path.iterdir()) == []  # no output, no partial folder
    assert multiprocessing.active_children() == []


def test_a_bug_in_a_worker_keeps_its_traceback(small_model_dir, tmp_path, monkeypatch):
    def bug():
        raise ValueError("a bug")

    _fail_in_chunk(monkeypatch, 2, bug)
    with pytest.raises(ValueError, match="a bug") as info:
        export_mod.export_model(str(small_model_dir), "0-0,1-1,2-2", tmp_path / "o", small_export_config(), jobs=2)
    assert any("in the export worker" in n and "in bug" in n for n in info.value.__notes__)
    assert list(tmp_path.iterdir()) == []


def test_a_worker_that_dies_is_named_and_the_others_stopped(small_model_dir, tmp_path, monkeypatch):
    _fail_in_chunk(monkeypatch, 0, lambda: os.kill(os.getpid(), signal.SIGKILL))
    with pytest.raises(ExportError, match=r"chunk 0: its export worker died .*--jobs 1"):
        export_mod.export_model(str(small_model_dir), "0-0,1-1,2-2", tmp_path / "o", small_export_config(), jobs=3)
    assert list(tmp_path.iterdir()) == []
    assert multiprocessing.active_children() == []


def test_fewer_workers_than_chunks_each_take_the_next():
    seen = []
    out = chunk_jobs.run_chunk_jobs(5, lambda k, say: (say(f"k{k}"), os.getpid(), k * k)[1:], 2, seen.append)
    assert [r[1] for r in out] == [0, 1, 4, 9, 16]  # in chunk order
    assert len({r[0] for r in out}) == 2 and os.getpid() not in {r[0] for r in out}
    assert sorted(seen) == [f"k{k}" for k in range(5)]


def test_default_jobs_follows_chunks_memory_and_threads(monkeypatch):
    import threading

    monkeypatch.setattr(chunk_jobs, "_available_memory_bytes", lambda: 64 * 2**30)
    monitor = threading.Thread(name="tqdm_monitor")  # tqdm's, which only sleeps
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), monitor])
    assert chunk_jobs.default_jobs(3, 100 * 2**20) == 3
    assert chunk_jobs.default_jobs(3, 10 * 2**30) == 2  # 64 GiB holds two workers of 3 x 10 GiB
    monkeypatch.setattr(chunk_jobs, "_available_memory_bytes", lambda: 2**30)
    assert chunk_jobs.default_jobs(3, 10 * 2**30) == 1
    stray = threading.Thread(name="someone-elses")
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), stray])
    monkeypatch.setattr(chunk_jobs, "_available_memory_bytes", lambda: 64 * 2**30)
    assert chunk_jobs.default_jobs(3, 100 * 2**20) == 1  # forking beside another thread is not safe


def test_cli_refuses_a_bad_jobs_value(tmp_path, capsys):
    from exporter.cli import main

    assert main(["--model", "tiny", "--jobs", "0", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--jobs '0' is not a positive number" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


_STOP_CHILD_AT_FORK = []  # os.register_at_fork cannot be undone: the hook acts only while this holds a pid


def _stop_the_child_at_fork():
    if _STOP_CHILD_AT_FORK:
        os.kill(os.getpid(), signal.SIGTERM)  # the earliest a parent's SIGTERM can reach a new worker


os.register_at_fork(after_in_child=_stop_the_child_at_fork)


def test_a_worker_stopped_as_it_starts_never_runs_the_parents_handler():
    # zl-export's SIGTERM handler raises KeyboardInterrupt; in a child stopped before it set its own,
    # that unwound the child through the parent's code (under xdist: a second pytest session)
    parent = os.getpid()

    def parents_handler(signum, frame):
        if os.getpid() != parent:
            os._exit(77)  # the child ran the parent's handler

    previous = signal.signal(signal.SIGTERM, parents_handler)
    _STOP_CHILD_AT_FORK.append(parent)
    try:
        with pytest.raises(ExportError, match=r"chunk [01]: its export worker died \(exit code -15"):
            chunk_jobs.run_chunk_jobs(2, lambda k, say: k, 2, lambda m: None)
    finally:
        _STOP_CHILD_AT_FORK.clear()
        signal.signal(signal.SIGTERM, previous)
    assert multiprocessing.active_children() == []
