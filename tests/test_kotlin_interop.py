"""Interop: the Kotlin core (kotlin_app/core), acting as a DEVICE, against the Python host side
of the wire protocol (zl_mobile.protocol) over loopback TCP.

The Kotlin classes are built by kotlin_app/run_tests.sh (kotlinc from npm, pinned). Nothing here
is skipped: without the toolchain these tests FAIL and say how to install it.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from zl_mobile.protocol import (ConnectionClosed, ErrorCode, Message, MsgType, ProtocolError,
                                host_handshake, new_token, recv_message, send_message)

ROOT = Path(__file__).resolve().parents[1]
KOTLIN_APP = ROOT / "kotlin_app"
RUN_TESTS = KOTLIN_APP / "run_tests.sh"
HOW = ("build the Kotlin core first: `bash kotlin_app/run_tests.sh` (installs kotlinc "
       "from npm and JUnit from Debian, compiles into kotlin_app/build/)")


@pytest.fixture(scope="module")
def classpath() -> str:
    if shutil.which("java") is None:
        pytest.fail("java is not on PATH; install a JDK 17 (apt-get install -y openjdk-17-jdk-headless), then " + HOW)
    # Build (or confirm up to date) without installing anything: a missing toolchain is an error.
    r = subprocess.run(["bash", str(RUN_TESTS), "--build-only", "--no-install"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"could not build the Kotlin core ({r.stderr.strip() or r.stdout.strip()}); {HOW}")
    cp = (KOTLIN_APP / "build" / "classpath.txt").read_text().strip()
    for part in cp.split(os.pathsep):
        if not Path(part).exists():
            pytest.fail(f"{part} from kotlin_app/build/classpath.txt is missing; {HOW}")
    return cp


class KotlinDevice:
    def __init__(self, classpath: str, tmp: Path, token: str):
        self.token = token
        self.proc = subprocess.Popen(
            ["java", "-cp", classpath, "org.zerolock.core.DeviceMain", "--port", "0", "--bind", "127.0.0.1",
             "--token", token, "--name", "kotlin-interop", "--dir", str(tmp), "--echo-hidden"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.port = None
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        for line in self.proc.stdout:
            if line.startswith("LISTENING "):
                self.port = int(line.split()[1])
                break
        if self.port is None:
            self.close()
            pytest.fail("Kotlin DeviceMain exited before listening:\n" + "".join(self.stderr))

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=20)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def device(classpath, tmp_path):
    d = KotlinDevice(classpath, tmp_path, new_token())
    yield d
    d.close()


def _assign(request_id: int, window_size: int = 2) -> Message:
    return Message(MsgType.STAGE_ASSIGN, {
        "request_id": request_id, "stage": 0, "num_stages": 1, "upstream": None, "downstream": None,
        "program_sha256": "ab" * 32, "window_size": window_size, "inflight_depth": 2, "buffer_capacity": 4,
        "run_id": "interop", "config": {"lr": 0.05}})


def _recv_until(sock, want: MsgType, seen: list[Message]) -> Message:
    while True:
        m = recv_message(sock)
        assert m.type != MsgType.ERROR, f"device sent ERROR {m.meta}"
        seen.append(m)
        if m.type == want:
            return m


def test_handshake_and_hidden_states_both_ways(device):
    with device.connect() as s:
        hello = host_handshake(s, device.token, "pytest-host")
        assert hello.type == MsgType.HELLO
        assert hello["name"] == "kotlin-interop" and hello["protocol_version"] == 1
        assert isinstance(hello["memory_bytes"], int) and "lora" in hello["capabilities"]

        send_message(s, Message(MsgType.HEARTBEAT, {"seq": 41}))
        hb = recv_message(s)
        assert hb.type == MsgType.HEARTBEAT and hb["seq"] == 41

        send_message(s, _assign(7))
        ack = recv_message(s)
        assert ack.type == MsgType.ACK and ack["request_id"] == 7 and ack["ok"] is True, ack

        rng = np.random.default_rng(0)
        sent = {}
        for mb in range(4):  # two update windows of 2 micro-batches
            h = rng.standard_normal((1, 3, 8)).astype(np.float32)
            labels = rng.integers(0, 32000, (1, 3)).astype(np.int64)
            mask = np.array([[False, True, True]])
            sent[mb] = (h, labels, mask)
            send_message(s, Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // 2},
                                    {"h": h, "labels": labels, "mask": mask}))

        seen: list[Message] = []
        hidden: dict[int, Message] = {}
        commits = []
        while len(hidden) < 4 or len(commits) < 2:
            m = _recv_until(s, MsgType.HIDDEN_STATE, seen) if len(hidden) < 4 else \
                _recv_until(s, MsgType.CHECKPOINT_COMMITTED, seen)
            if m.type == MsgType.HIDDEN_STATE:
                hidden[m["micro_batch"]] = m
                send_message(s, Message(MsgType.CREDIT, {"credits": 1, "micro_batch": m["micro_batch"]}))
            commits = [x for x in seen if x.type == MsgType.CHECKPOINT_COMMITTED]

        # h_k from the Kotlin stand-in chunk: h * (1 + a) + b, with a = 0, b = 0.5 before any update
        h0, labels0, mask0 = sent[0]
        out0 = hidden[0]
        assert out0["window"] == 0
        np.testing.assert_allclose(out0.tensors["h"], h0 + np.float32(0.5), rtol=0, atol=0)
        np.testing.assert_array_equal(out0.tensors["labels"], labels0)
        np.testing.assert_array_equal(out0.tensors["mask"], mask0)
        assert out0.tensors["h"].dtype == np.float32 and out0.tensors["h"].shape == (1, 3, 8)

        credits = [x for x in seen if x.type == MsgType.CREDIT]
        assert sorted(c["micro_batch"] for c in credits) == [0, 1, 2, 3]
        assert [c["window"] for c in commits] == [0, 1] and [c["step"] for c in commits] == [1, 2]
        telemetry = [x for x in seen if x.type == MsgType.TELEMETRY]
        assert telemetry and telemetry[0]["stage"] == 0 and "task_loss" in telemetry[0].meta
        assert all(isinstance(t["pss_bytes"], int) for t in telemetry)

        send_message(s, Message(MsgType.STATE_GET, {"request_id": 9, "kind": "optimizer"}))
        st = _recv_until(s, MsgType.STATE_PUT, [])
        assert st["request_id"] == 9 and st["step"] == 2
        assert set(st.tensors) == {"exp_avg/a", "exp_avg_sq/a", "exp_avg/b", "exp_avg_sq/b"}

        send_message(s, Message(MsgType.SHUTDOWN, {"reason": "test over"}))
        with pytest.raises((ConnectionClosed, ConnectionResetError)):
            recv_message(s)


def test_wrong_token_is_refused(device):
    with device.connect() as s:
        with pytest.raises(ProtocolError) as ei:
            host_handshake(s, new_token(), "impostor")
        assert ei.value.code == ErrorCode.UNAUTHENTICATED
    # and the right token still works afterwards (the refused attempt held no session slot)
    with device.connect() as s:
        assert host_handshake(s, device.token)["name"] == "kotlin-interop"


def test_second_host_is_busy_and_preauth_messages_are_refused(device):
    with device.connect() as s1:
        host_handshake(s1, device.token)
        with device.connect() as s2:
            with pytest.raises(ProtocolError) as ei:
                host_handshake(s2, device.token)
            assert ei.value.code == ErrorCode.BUSY
    with device.connect() as s3:
        send_message(s3, Message(MsgType.HEARTBEAT, {"seq": 1}))
        err = recv_message(s3)
        assert err.type == MsgType.ERROR and err["code"] == "UNAUTHENTICATED"
