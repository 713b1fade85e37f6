"""host.devices.adb: dumpsys parsers on sample outputs, and discovery against a real adb server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from host.devices.adb import (
    AdbPhone,
    AdbUnavailable,
    DumpsysParseError,
    adb_status,
    find_adb,
    list_adb_devices,
    parse_battery_temp_c,
    parse_meminfo_pss_kib,
    read_pss_kib,
)

DATA = Path(__file__).parent / "data" / "dumpsys"


def sample(name: str) -> str:
    return (DATA / name).read_text()


# ------------------------------------------------------------------ meminfo

@pytest.mark.parametrize("name, pss", [
    # captured on phones (sources in tests/data/dumpsys/README.md)
    ("meminfo_pixel2_android11.txt", 688561),                  # Pixel 2, Android 11
    ("meminfo_unity_package_android8-10_layout.txt", 312674),  # older layout, no Rss column
    ("meminfo_unity_native_process.txt", 1383),                # a native process: no MEMINFO header
    ("meminfo_launcher3_android11plus_layout.txt", 105529),    # 'dumpsys meminfo -a -d', Rss column
    # written to the AOSP layouts (README.md)
    ("meminfo_android8.txt", 60743),
    ("meminfo_android10.txt", 83211),
    ("meminfo_android12.txt", 158529),
    ("meminfo_android14.txt", 2826628),
])
def test_meminfo_samples(name, pss):
    text = sample(name)
    assert parse_meminfo_pss_kib(text) == pss
    # the table's TOTAL row alone gives the same number (layouts without an App Summary)
    table_only = text.split(" App Summary")[0]
    assert parse_meminfo_pss_kib(table_only) == pss
    # CRLF (adb shell on old devices / Windows hosts) parses too
    assert parse_meminfo_pss_kib(text.replace("\n", "\r\n")) == pss


def test_meminfo_summary_lines_take_precedence():
    newer = "           TOTAL PSS:   105529            TOTAL RSS:   187052      TOTAL SWAP (KB):        0\n"
    older = "               TOTAL:    42905       TOTAL SWAP PSS:        0\n"
    row = "        TOTAL    42905    32332     4820        0    27029    17737     9291\n"
    assert parse_meminfo_pss_kib(newer) == 105529
    assert parse_meminfo_pss_kib(older) == 42905
    assert parse_meminfo_pss_kib(row) == 42905


def test_meminfo_several_processes_are_summed():
    text = sample("meminfo_android12.txt") + sample("meminfo_android14.txt").replace(
        "[org.zerolock.app]", "[org.zerolock.app:stage]")
    assert parse_meminfo_pss_kib(text) == 158529 + 2826628


def test_meminfo_no_process_and_garbage():
    with pytest.raises(DumpsysParseError, match="org.zerolock.app is not running.*start the app"):
        parse_meminfo_pss_kib(sample("meminfo_no_process.txt"))
    for garbage in ("", "hello\nworld", "Total RAM: 5,632,216K (status normal)\n",
                    sample("battery_android8.txt")):
        with pytest.raises(DumpsysParseError, match="no 'TOTAL PSS:'") as e:
            parse_meminfo_pss_kib(garbage)
        assert "\n" not in str(e.value)
    # a block header with no totals in it is not silently counted as 0
    with pytest.raises(DumpsysParseError):
        parse_meminfo_pss_kib(sample("meminfo_android8.txt")
                              + "** MEMINFO in pid 1 [x] **\n(truncated)\n")
    with pytest.raises(DumpsysParseError, match="must be text"):
        parse_meminfo_pss_kib(b"TOTAL PSS: 1")


def test_read_pss_rejects_odd_package_names():
    with pytest.raises(ValueError, match="package"):
        read_pss_kib("serial", "org.x; reboot")


# ------------------------------------------------------------------ battery

@pytest.mark.parametrize("name, temp", [
    ("battery_samsung_s24.txt", 35.7),     # captured: Galaxy S24, with Samsung's extra sections
    ("battery_samsung_2018.txt", 32.6),    # captured: a Samsung phone in 2018
    ("battery_android8.txt", 31.2),
    ("battery_android11.txt", 28.7),
    ("battery_android14.txt", 41.5),
    ("battery_emulator_updates_stopped.txt", 25.0),
])
def test_battery_samples(name, temp):
    assert parse_battery_temp_c(sample(name)) == pytest.approx(temp)
    assert parse_battery_temp_c(sample(name).replace("\n", "\r\n")) == pytest.approx(temp)


def test_battery_event_log_temperatures_are_not_the_current_one():
    """Samsung's dumpsys battery appends logs of earlier ACTION_BATTERY_CHANGED broadcasts, each with
    its own 'temperature:NNN'; only the service state's own line counts."""
    text = sample("battery_samsung_s24.txt")
    assert "temperature:362," in text and "mSavedBatteryMaxTemp: 512" in text
    assert parse_battery_temp_c(text) == pytest.approx(35.7)
    head, _, log = text.partition("[EventLogBuffer]")
    assert parse_battery_temp_c(head) == pytest.approx(35.7)
    with pytest.raises(DumpsysParseError):    # the logs alone hold no current temperature
        parse_battery_temp_c(log)


def test_battery_negative_and_garbage():
    assert parse_battery_temp_c("  temperature: -45\n") == pytest.approx(-4.5)
    for garbage in ("", "Current Battery Service state:\n  level: 50\n",
                    "  temperature: hot\n", sample("meminfo_android12.txt")):
        with pytest.raises(DumpsysParseError, match="no 'temperature:") as e:
            parse_battery_temp_c(garbage)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ discovery

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def adb_server():
    """A private adb server on a free port (not the user's 5037), killed afterwards."""
    adb = shutil.which("adb")
    if adb is None:
        pytest.skip("adb is not on PATH (CI installs Debian's adb package)")
    port = _free_port()
    subprocess.run([adb, "-P", str(port), "start-server"], capture_output=True, timeout=30,
                   check=True)
    yield adb, port
    subprocess.run([adb, "-P", str(port), "kill-server"], capture_output=True, timeout=30)


def test_running_server_without_device(adb_server):
    adb, port = adb_server
    phones = list_adb_devices(port=port, start_server=False)
    if phones:
        pytest.skip(f"a device is attached to this machine: {phones}")
    assert phones == []
    status = adb_status(port=port, start_server=False)
    assert status.kind == "no-device" and status.phones == []
    assert f"adb server running on 127.0.0.1:{port}, no device attached" in status.message


def test_server_is_started_when_absent():
    adb = shutil.which("adb")
    if adb is None:
        pytest.skip("adb is not on PATH")
    port = _free_port()
    try:
        status = adb_status(port=port)
        assert status.kind in ("no-device", "ok")
        assert f"started with {adb} on 127.0.0.1:{port}" in status.message
    finally:
        subprocess.run([adb, "-P", str(port), "kill-server"], capture_output=True, timeout=30)


def test_adb_missing_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))          # no adb on PATH
    monkeypatch.delenv("ZL_ADB", raising=False)
    monkeypatch.delenv("ADBUTILS_ADB_PATH", raising=False)
    port = _free_port()                                # and no server listening
    assert find_adb(bundled=False) is None
    status = adb_status(port=port, bundled=False)
    assert status.kind == "adb-missing" and status.phones == []
    assert f"no adb server on 127.0.0.1:{port} and no adb binary found" in status.message
    assert "apt-get install adb" in status.message
    with pytest.raises(AdbUnavailable) as e:
        list_adb_devices(port=port, bundled=False)
    assert e.value.kind == "adb-missing"
    # without starting, a present binary but absent server is its own case
    fake = tmp_path / "adb"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    assert find_adb(bundled=False) == str(fake)
    assert adb_status(port=port, start_server=False).kind == "no-server"
    failed = adb_status(port=port)                     # the "adb" there cannot start a server
    assert failed.kind == "server-failed" and "start-server" in failed.message


def test_explicit_adb_path_and_bundled(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("ADBUTILS_ADB_PATH", raising=False)
    monkeypatch.setenv("ZL_ADB", str(tmp_path / "missing-adb"))
    assert find_adb() is None                          # an explicit but wrong path is not ignored
    monkeypatch.delenv("ZL_ADB")
    bundled = find_adb(bundled=True)                   # adbutils' wheel may ship its own adb
    assert bundled is None or os.path.basename(bundled).startswith("adb")


def test_phone_record():
    assert AdbPhone("R58M", "SM G991B", "device").ready
    assert not AdbPhone("R58M", "", "unauthorized").ready
