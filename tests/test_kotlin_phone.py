"""Kotlin phones: the app's core (kotlin_app/core) on the JVM, running the exported chunks through
ExecuTorch's C++ runtime (kotlin_app/jni), as real processes in real pipelines beside zl-phone.

Parity: the same runtime (the executorch wheel's libraries), the same inputs, the same LoRA
initialisation (the export's lora_init) give bit-identical losses and gradients on both phones.
The LoRA after several windows is not bit-identical: zl_mobile's AdamW runs torch's float32
sqrt, which on CPU is not correctly rounded (torch 2.13: 670 of 4096 random values 1 ulp off),
while the Kotlin core's sqrt is (IEEE). The denominators sqrt(v) differ by at most 1 ulp per step,
so the LoRA agree to about 1e-6 relative (measured: 6e-7 on AMD EPYC, 1.02e-6 on an Intel Xeon CI machine, 3
windows); asserted under 1e-5: lora_B starts at zero, so a lost or repeated window would be off by a sizable fraction."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from host.cli.error import CliError
from host.phones.emulate import start_phones
from host.phones.emulated_phone import EmulatorError
from host.phones.kotlin_phone import KotlinPhone, classpath, parse_runtimes
from host.run.settings import RunSettings
from tests.conftest import small_micro_batches

WINDOWS = 3


@pytest.fixture(scope="module")
def built():
    return classpath()  # builds the Kotlin core and the bridge (never installs: a missing toolchain fails)


def assert_same_training(result, records, base, windows: int, recoveries: int | None = 1) -> None:
    """Every stage committed every window once, `recoveries` recoveries caught up, and the LoRA is
    the uninterrupted run's bit for bit (the same windows, applied once, in order)."""
    assert sorted((r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED") == \
        [(k, w) for k in range(3) for w in range(windows)]
    if recoveries is not None:
        assert len(result["recoveries"]) == recoveries and all(r["caught_up"] for r in result["recoveries"])
    for n in base["lora"]:
        assert np.array_equal(result["lora"][n], base["lora"][n]), n


def _run(export_dir: Path, root: Path, runtimes: list[str], phones_out: list | None = None, settings=None, on_event=None):
    from host.run.coordinator import Coordinator

    phones = start_phones(len(runtimes), root / "phones", prefix=f"k{os.getpid()}-", runtimes=runtimes)
    if phones_out is not None:
        phones_out.extend(phones)
    try:
        settings = settings or RunSettings(windows=WINDOWS, window_size=2, lr=2e-2, inflight_depth=4)
        settings.max_seconds = 240
        mbs = small_micro_batches(export_dir, n_examples=4)
        result = Coordinator(export_dir, [p.handle() for p in phones], mbs, settings, root / "run", run_id="t",
                             on_event=on_event).run()
    finally:
        for p in phones:
            p.stop()
    records = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, records


def _losses(records) -> dict:
    return {(r["stage"], r["micro_batch"]): r["loss"] for r in records
            if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"}


def _worst_relative(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float(np.linalg.norm(np.asarray(a[n]) - np.asarray(b[n])) / max(np.linalg.norm(np.asarray(b[n])), 1e-30))
               for n in a)


@pytest.fixture(scope="module")
def runs(small_export, built, tmp_path_factory):
    out = small_export[0]
    return {name: _run(out, tmp_path_factory.mktemp(name.replace(",", "-")), name.split(","))
            for name in ("python,python,python", "kotlin,kotlin,kotlin", "python,kotlin,python")}


@pytest.mark.parametrize("name", ["kotlin,kotlin,kotlin", "python,kotlin,python"])
def test_kotlin_pipelines_train_to_the_python_lora(runs, name):
    assert_same_as_python(runs[name], runs["python,python,python"], name)


def test_kotlin_phones_train_an_int4_base_to_the_python_lora(small_export_int4, built, tmp_path):
    """The Kotlin core runs the int4 programs (packed int8 weights, their XNNPACK decodes) as Python phones do."""
    out = small_export_int4[0]
    assert_same_as_python(_run(out, tmp_path / "kt", ["kotlin"] * 3), _run(out, tmp_path / "py", ["python"] * 3),
                          "kotlin on int4")


def assert_same_as_python(run, python_run, name):
    (result, records), (ref_result, ref_records) = run, python_run
    commits = sorted((r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED")
    assert commits == [(k, w) for k in range(3) for w in range(WINDOWS)], "each window committed once per stage"
    mine, ref = _losses(records), _losses(ref_records)
    assert set(mine) == set(ref)
    # window 0 runs on the export's lora_init: same program, same inputs, same runtime -> same bits
    assert {k: v for k, v in mine.items() if k[1] < 2} == {k: v for k, v in ref.items() if k[1] < 2}
    assert set(result["lora"]) == set(ref_result["lora"])
    moved = max(float(np.abs(np.asarray(v)).max()) for n, v in result["lora"].items() if "lora_B" in n)
    assert moved > 1e-3, "training moved lora_B"
    worst = _worst_relative(result["lora"], ref_result["lora"])
    assert worst <= 1e-5, f"{name}: LoRA {worst:.2e} relative from the all-Python run's"


def test_kotlin_phone_says_its_runtime(small_export, built, tmp_path):
    """HELLO's runtime_version names the Kotlin core, and its memory reading is the JVM process's PSS."""
    import socket

    from zl_mobile.protocol import host_handshake

    phone = KotlinPhone("kt-hello", tmp_path / "kt", "ab" * 32).start()
    try:
        with socket.create_connection(("127.0.0.1", phone.port), timeout=10) as s:
            s.settimeout(10)
            hello = host_handshake(s, phone.token, "zl-host")
        assert hello["runtime_version"] == "kotlin/executorch"
    finally:
        phone.stop()
    assert not phone.alive()


def test_runtime_option_is_checked():
    assert parse_runtimes(None, 3) == ["python"] * 3
    assert parse_runtimes("kotlin", 2) == ["kotlin", "kotlin"]
    assert parse_runtimes("python,kotlin,python", 3) == ["python", "kotlin", "python"]
    with pytest.raises(CliError, match="'java' is not a phone runtime; use python or kotlin"):
        parse_runtimes("python,java,python", 3)
    with pytest.raises(CliError, match="names 2 runtimes for 3 phones"):
        parse_runtimes("python,kotlin", 3)


def test_kotlin_phone_refuses_options_it_lacks(built, tmp_path):
    with pytest.raises(EmulatorError, match="--backend is a zl-phone option Kotlin phones do not have yet"):
        KotlinPhone("kt-x", tmp_path / "x", "cd" * 32, ["--backend", "eager"]).start()


def test_zl_host_run_refuses_runtime_for_real_devices(small_export, capsys):
    from host.cli.zl_host import main

    rc = main(["run", "--program", str(small_export[0]), "--devices", "phone-a,phone-b", "--runtime", "kotlin"])
    err = capsys.readouterr().err
    assert rc == 2 and "--runtime picks what emulated phones run" in err, err


@pytest.fixture(scope="module")
def baselines(small_export, built, tmp_path_factory):
    """Uninterrupted runs by phone runtimes, the references of the recovery tests (same phones, same bits)."""
    cache = {}

    def get(runtimes: list[str]):
        key = ",".join(runtimes)
        if key not in cache:
            cache[key] = _run(small_export[0], tmp_path_factory.mktemp("base"), runtimes,
                              settings=RunSettings(windows=6, window_size=2, lr=2e-2, inflight_depth=2))
        return cache[key]
    return get


@pytest.mark.parametrize("runtimes,stage", [(["kotlin"] * 3, 2), (["kotlin"] * 3, 1), (["python", "kotlin", "python"], 1)])
def test_kill_9_of_a_kotlin_phone_mid_run_ends_with_the_uninterrupted_lora(small_export, baselines, tmp_path,
                                                                          runtimes, stage):
    """A real SIGKILL of a Kotlin phone's JVM once its stage committed window 2: the host restarts
    it, the stage restores its checkpoint, its upstream replays, and the run ends as the
    uninterrupted one with the same phones, bit for bit, every window committed once."""
    base, base_records = baselines(runtimes)
    phones, killed, events = [], [], []

    def on_event(kind, data):
        events.append((kind, data))
        if kind == "checkpoint_committed" and data["stage"] == stage and data["window"] == 2 and not killed:
            phone = next(p for p in phones if p.name == data["device"])
            assert isinstance(phone, KotlinPhone)
            phone.kill()
            killed.append(phone.name)

    result, records = _run(small_export[0], tmp_path, runtimes, phones_out=phones, on_event=on_event,
                           settings=RunSettings(windows=6, window_size=2, lr=2e-2, inflight_depth=2))
    assert killed
    assert [d["stage"] for k, d in events if k == "failure"] == [stage]
    assert_same_training(result, records, base, windows=6)


def test_kill_9_of_a_kotlin_upstream_that_ran_ahead_replays_from_disk(small_export, built, tmp_path_factory):
    """Stage 1 (Kotlin) runs ahead of a slowed Python stage 2 until its replay buffer holds the
    horizon, commits window 3, and is killed -9: its restarted JVM reloads what it had sent and
    stage 2 has not committed from the on-disk copy (it cannot recompute it: its LoRA moved on),
    learns stage 2's commit from the re-announcement on the new link, and the run ends with the
    uninterrupted run's LoRA bit for bit."""
    runtimes = ["kotlin", "kotlin", "python"]
    slower = [{"stage": 2, "point": "slow-phase1", "seconds": 0.25}]

    def settings():
        return RunSettings(windows=8, window_size=2, lr=2e-2, inflight_depth=2, inject_failure=list(slower))

    base, _ = _run(small_export[0], tmp_path_factory.mktemp("ahead-base"), runtimes, settings=settings())
    phones, killed, behind = [], [], []
    committed = {0: -1, 1: -1, 2: -1}

    def on_event(kind, data):
        if kind == "checkpoint_committed":
            committed[data["stage"]] = max(committed[data["stage"]], data["window"])
            if data["stage"] == 1 and data["window"] == 3 and not killed:
                behind.append(committed[2])
                phone = next(p for p in phones if p.name == data["device"])
                phone.kill()
                killed.append(phone.name)

    result, records = _run(small_export[0], tmp_path_factory.mktemp("ahead"), runtimes, phones_out=phones,
                           on_event=on_event, settings=settings())
    assert killed and behind[0] < 3, f"stage 2 had committed window {behind} when stage 1 was killed: not behind"
    assert_same_training(result, records, base, windows=8)


# An injected failure at each point (zl_mobile.stage FAILURE_POINTS; the Kotlin core's FaultInjector),
# in both modes, on Kotlin phones and across the runtimes' boundary: stage 1 of python,kotlin,python is
# a Kotlin upstream under a Python downstream, its stage 0 a Python upstream under a Kotlin downstream.
INJECTED = [
    pytest.param(["kotlin"] * 3, 1, "after-phase1", "process", None, id="kotlin-after-phase1"),
    pytest.param(["kotlin"] * 3, 2, "before-commit", "process", None, id="kotlin-before-commit"),
    pytest.param(["kotlin"] * 3, 1, "mid-checkpoint", "process", None, id="kotlin-mid-checkpoint"),
    pytest.param(["kotlin"] * 3, 1, "after-phase1", "app", "connection", id="kotlin-app-after-phase1"),
    pytest.param(["kotlin"] * 3, 2, "mid-checkpoint", "app", "heartbeat", id="kotlin-app-mid-checkpoint-heartbeat"),
    pytest.param(["python", "kotlin", "python"], 1, "before-commit", "process", None, id="kotlin-up-python-down"),
    pytest.param(["python", "kotlin", "python"], 1, "mid-checkpoint", "app", "connection", id="kotlin-up-python-down-app"),
    pytest.param(["python", "kotlin", "python"], 0, "after-phase1", "process", None, id="python-up-kotlin-down"),
]


@pytest.mark.parametrize("runtimes,stage,point,mode,detect", INJECTED)
def test_an_injected_failure_ends_with_the_uninterrupted_lora(small_export, baselines, tmp_path, runtimes, stage,
                                                              point, mode, detect):
    """`--inject-failure stage=K,window=2,point=P[,mode=app,detect=D]`: the phone fails there once
    (process: it exits with zl_mobile's FAILURE_EXIT_CODE and the host restarts it; app: the stage
    drops its memory inside the running phone, which closes the session or goes silent, and the host
    reconnects to the same process), the stage restores its last checkpoint (mid-checkpoint: never
    the half-written one), its upstream replays, and the run ends with the uninterrupted run's LoRA
    bit for bit, every window committed once per stage."""
    from host.run.config import parse_failures
    from zl_mobile.stage import FAILURE_EXIT_CODE

    base, _ = baselines(runtimes)
    spec = f"stage={stage},window=2,point={point}" + (f",mode={mode},detect={detect}" if mode == "app" else "")
    phones, events, seen = [], [], {}

    def on_event(kind, data):
        events.append((kind, data))
        if kind in ("failure", "rejoined"):
            phone = next(p for p in phones if p.name == data["device"])
            seen[kind] = (phone, phone.proc)
            if kind == "failure" and mode == "process":
                seen["exit"] = phone.proc.wait(timeout=20)  # it halted by itself: no signal
            elif kind == "failure":
                seen["exit"] = phone.proc.poll()

    settings = RunSettings(windows=6, window_size=2, lr=2e-2, inflight_depth=2, inject_failure=parse_failures([spec]),
                           heartbeat_timeout=2.0 if detect == "heartbeat" else 5.0)
    result, records = _run(small_export[0], tmp_path, runtimes, phones_out=phones, on_event=on_event, settings=settings)
    failures = [d for k, d in events if k == "failure"]
    assert [d["stage"] for d in failures] == [stage], failures  # detected, once, on the failed stage only
    assert [d["stage"] for k, d in events if k == "rejoined"] == [stage]
    assert ("no heartbeat" in failures[0]["why"]) == (detect == "heartbeat"), failures[0]["why"]
    phone, proc_at_failure = seen["failure"]
    if mode == "process":
        assert seen["exit"] == FAILURE_EXIT_CODE and seen["rejoined"][1] is not proc_at_failure  # restarted
    else:
        assert seen["exit"] is None and seen["rejoined"][1] is proc_at_failure  # the same process, reconnected
    log = phone.log_path.read_text(errors="replace")
    assert f"stage {stage}: injected failure ({mode}) at {point} of window 2" in log
    if phone.runtime == "kotlin" and point == "mid-checkpoint":
        assert "left a half-written checkpoint" in log
    assert_same_training(result, records, base, windows=6)


def test_a_stalled_kotlin_phase_is_not_taken_for_a_dead_phone(small_export, baselines, tmp_path):
    """hold-gil-in-phase1 on a Kotlin phone (FaultInjector: HEARTBEAT busy_ms, then phase 1 stalls
    with the device's heartbeats paused) lasts 3 s under a 1 s heartbeat timeout: no failure, as on
    a Python phone. The other Kotlin phones, waiting for it, keep sending heartbeats
    (--heartbeat-ms), so none of them is taken for dead either."""
    base, base_records = baselines(["kotlin"] * 3)
    events = []
    stall = {"stage": 1, "window": 1, "point": "hold-gil-in-phase1", "seconds": 3.0}
    settings = RunSettings(windows=6, window_size=2, lr=2e-2, inflight_depth=2, heartbeat_timeout=1.0,
                           inject_failure=[stall])
    result, records = _run(small_export[0], tmp_path, ["kotlin"] * 3, on_event=lambda k, d: events.append((k, d)),
                           settings=settings)
    assert [d for k, d in events if k == "failure"] == [] and result["recoveries"] == []
    stalled = [r for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"
               and (r["stage"], r["window"]) == (1, 1)]
    assert max(r["phase1_end"] - r["phase1_start"] for r in stalled) >= 3.0  # the stall did happen
    assert_same_training(result, records, base, windows=6, recoveries=None)


def test_kotlin_phone_mem_limit_kills_and_bad_size_is_refused(built, tmp_path):
    """--mem-limit is passed through (host/phones/kotlin_phone.py) and acts as zl-phone's: a JVM over its limit
    ends at once with exit 137 and the one-line reason; a bad size is exit 2 before anything is created."""
    import subprocess

    from host.phones.kotlin_phone import java_command
    from zl_mobile.memlimit import KILLED_EXIT_CODE

    # a JVM's resident set is well over 24 MiB before it listens: the watchdog ends it
    cmd = java_command("kt-mem", tmp_path / "mem", "ef" * 32, 0, "127.0.0.1", ["--mem-limit", "24M"])
    assert cmd[cmd.index("--mem-limit") + 1] == "24M"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == KILLED_EXIT_CODE, r.stderr
    line = [ln for ln in r.stderr.splitlines() if "killed" in ln]
    assert len(line) == 1 and "kotlin-phone kt-mem: killed: memory (PSS)" in line[0], r.stderr
    assert "passed --mem-limit 24.0 MiB (as a phone's low-memory killer would)" in line[0]

    bad = java_command("kt-bad", tmp_path / "bad", "ef" * 32, 0, "127.0.0.1", ["--mem-limit", "12X"])
    r = subprocess.run(bad, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert r.stderr.strip() == ("DeviceMain: error: --mem-limit: memory size '12X' is not a number with an optional "
                                "unit: give e.g. 600M or 1.5G")
    assert not (tmp_path / "bad").exists()


def test_kotlin_phone_hello_reports_its_budget(built, tmp_path):
    """HELLO's cores, cpu_share and memory_budget_bytes as a zl-phone sends them (zl_mobile/device.py), so
    zl-host plan's budgets work with Kotlin phones: a phone started with --cpu-share 0.5 --mem-limit 600M
    (under the CPU-budget launcher) reports both; one without reports no share and MemAvailable."""
    import socket

    from host.phones.kotlin_phone import txt_for
    from zl_mobile.memlimit import available_bytes
    from zl_mobile.protocol import host_handshake
    from zl_mobile.telemetry import total_memory_bytes

    def hello_of(phone):
        with socket.create_connection(("127.0.0.1", phone.port), timeout=10) as s:
            s.settimeout(10)
            return host_handshake(s, phone.token, "zl-host").meta

    budgeted = KotlinPhone("kt-budget", tmp_path / "b", "12" * 32, ["--cpu-share", "0.5", "--mem-limit", "600M"])
    plain = KotlinPhone("kt-plain", tmp_path / "p", "34" * 32)
    try:
        budgeted.start()
        plain.start()
        # the launcher really holds it: the JVM runs in a cgroup of its own
        assert "zerolock/phone-" in Path(f"/proc/{budgeted.proc.pid}/cgroup").read_text()
        h = hello_of(budgeted)
        assert h["cpu_share"] == 0.5 and isinstance(h["cpu_share"], float)
        assert h["memory_budget_bytes"] == 600 * 2**20 and isinstance(h["memory_budget_bytes"], int)
        assert h["cores"] == len(os.sched_getaffinity(0)) and isinstance(h["cores"], int)
        assert txt_for(budgeted)["cpu_share"] == "0.5"
        h = hello_of(plain)
        assert "cpu_share" not in h and "cpu_share" not in txt_for(plain)
        assert h["memory_bytes"] == total_memory_bytes()  # the device's RAM, as zl-phone's (issue 51: not -Xmx)
        assert h["cores"] == len(os.sched_getaffinity(0))
        # MemAvailable read afresh at the handshake: near this reading, not a fixed number
        assert abs(h["memory_budget_bytes"] - available_bytes()) < 512 * 2**20
    finally:
        budgeted.stop()
        plain.stop()


def test_kotlin_phone_takes_link_shaping_options(built, tmp_path):
    """--rate-mbit and --link-delay-ms reach DeviceMain (paced and delayed links: ShapedLinkTest in JUnit);
    a phone started with them serves; a bad value is exit 2 with a one-line error."""
    import socket
    import subprocess

    from host.phones.kotlin_phone import java_command
    from zl_mobile.protocol import host_handshake

    shaped = ["--rate-mbit", "10", "--link-delay-ms", "5"]
    cmd = java_command("kt-s", tmp_path / "s", "56" * 32, 0, "127.0.0.1", shaped)
    assert cmd[-4:] == shaped
    phone = KotlinPhone("kt-shaped", tmp_path / "k", "78" * 32, shaped).start()
    try:
        with socket.create_connection(("127.0.0.1", phone.port), timeout=10) as s:
            s.settimeout(10)
            assert host_handshake(s, phone.token, "zl-host")["name"] == "kt-shaped"
    finally:
        phone.stop()
    for opt, val, why in [("--rate-mbit", "0", "--rate-mbit must be a number of Mbit/s above 0 (e.g. 20), got '0'"),
                          ("--link-delay-ms", "-3", "--link-delay-ms must be >= 0, got '-3'")]:
        r = subprocess.run(java_command("kt-b", tmp_path / "b", "56" * 32, 0, "127.0.0.1", [opt, val]),
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and r.stderr.strip() == f"DeviceMain: error: {why}", r.stderr
