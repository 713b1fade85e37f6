"""Interop: the Kotlin core (kotlin_app/core), acting as a DEVICE, against the Python host side
of the wire protocol (zl_mobile.protocol) and the Python stage links (zl_mobile.links) over
loopback TCP: the host's feed (an OutboundLink) into the Kotlin stage's data port, and the Kotlin
stage's h_k into a Python InboundLink, with the link rules of docs/PROTOCOL.md 5.4.1 on both sides.

The Kotlin classes are built by kotlin_app/run_tests.sh (kotlinc from npm, pinned). Nothing here
is skipped: without the toolchain these tests FAIL and say how to install it.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from zl_mobile.link_rules import InboundQueue
from zl_mobile.links import InboundLink, OutboundLink
from zl_mobile.protocol import ErrorCode, Message, MsgType, ProtocolError, host_handshake, new_token, recv_message, send_message

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
            ["java", "-cp", classpath, "org.zerolock.core.device.DeviceMain", "--runtime", "affine", "--port", "0",
             "--bind", "127.0.0.1",
             "--token", token, "--name", "kotlin-interop", "--dir", str(tmp)],
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

    def kill(self):
        self.proc.kill()
        self.proc.wait()

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


def _assign(request_id: int, feed_token: str, window_size: int = 2, downstream: str | None = None,
            downstream_token: str | None = None) -> Message:
    meta = {"request_id": request_id, "stage": 0, "num_stages": 1, "upstream": "host", "downstream": downstream,
            "program_sha256": "ab" * 32, "window_size": window_size, "inflight_depth": 2, "replay_horizon": 16,
            "run_id": "interop", "upstream_token": feed_token, "config": {"lr": 0.05}}
    if downstream_token:
        meta["downstream_token"] = downstream_token
    return Message(MsgType.STAGE_ASSIGN, meta)


def _recv_until(sock, want: MsgType, seen: list[Message]) -> Message:
    while True:
        m = recv_message(sock)
        assert m.type != MsgType.ERROR, f"device sent ERROR {m.meta}"
        seen.append(m)
        if m.type == want:
            return m


def _recv_while(sock, seen: list[Message], more) -> None:
    while more():
        m = recv_message(sock)
        assert m.type != MsgType.ERROR, f"device sent ERROR {m.meta}"
        seen.append(m)


def _of(seen: list[Message], t: MsgType) -> list[Message]:
    return [m for m in seen if m.type == t]


def _telemetry(seen: list[Message], kind: str = "micro_batch") -> list[Message]:
    """TELEMETRY records of one kind (PROTOCOL.md 5.5: `micro_batch` when `kind` is absent)."""
    return [m for m in _of(seen, MsgType.TELEMETRY) if m.meta.get("kind", "micro_batch") == kind]


def _wait(what: str, cond, timeout: float = 20.0) -> None:
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_handshake_and_hidden_states_both_ways(device):
    feed_token, out_token = new_token(), new_token()
    out_queue = InboundQueue()
    collector = InboundLink("collector", out_token, out_queue, inflight_depth=2,
                            next_needed=lambda: out_queue.next_after(0), port=0, bind="127.0.0.1")
    feed = None
    with device.connect() as s:
        hello = host_handshake(s, device.token, "pytest-host")
        assert hello.type == MsgType.HELLO
        assert hello["name"] == "kotlin-interop" and hello["protocol_version"] == 2
        assert isinstance(hello["memory_bytes"], int) and "lora" in hello["capabilities"]

        send_message(s, Message(MsgType.HEARTBEAT, {"seq": 41}))
        hb = recv_message(s)
        assert hb.type == MsgType.HEARTBEAT and hb["seq"] == 41

        send_message(s, _assign(7, feed_token, downstream=f"127.0.0.1:{collector.port}", downstream_token=out_token))
        ack = recv_message(s)
        assert ack.type == MsgType.ACK and ack["request_id"] == 7 and ack["ok"] is True, ack
        assert ack["committed_window"] == -1 and ack["next_micro_batch"] == 0 and ack["data_port"] > 0

        # the host's feed into stage 0 is an OutboundLink, exactly as zl-host's coordinator does it
        feed = OutboundLink("host-feed", feed_token, window_size=2, replay_horizon=16, prune_on_commit=False)
        feed.set_address(f"127.0.0.1:{ack['data_port']}")
        rng = np.random.default_rng(0)
        sent = {}
        for mb in range(4):  # two update windows of 2 micro-batches
            h = rng.standard_normal((1, 3, 8)).astype(np.float32)
            labels = rng.integers(0, 32000, (1, 3)).astype(np.int64)
            mask = np.array([[False, True, True]])
            sent[mb] = (h, labels, mask)
            feed.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // 2},
                                 {"h": h, "labels": labels, "mask": mask}))

        hidden = {}
        for mb in range(4):  # the Kotlin stage's h_k arrives on the Python InboundLink, within credits
            m = out_queue.take(mb, timeout=20)
            assert m is not None, f"no h_k for micro-batch {mb}"
            collector.grant(1)
            hidden[mb] = m

        seen: list[Message] = []
        _recv_while(s, seen, lambda: len(_of(seen, MsgType.CHECKPOINT_COMMITTED)) < 2
                    or len(_telemetry(seen)) < 4)
        commits = _of(seen, MsgType.CHECKPOINT_COMMITTED)

        # h_k from the Kotlin stand-in chunk: h * (1 + a) + b, with a = 0, b = 0.5 before any update
        h0, labels0, mask0 = sent[0]
        out0 = hidden[0]
        assert out0["window"] == 0
        np.testing.assert_allclose(out0.tensors["h"], h0 + np.float32(0.5), rtol=0, atol=0)
        np.testing.assert_array_equal(out0.tensors["labels"], labels0)
        np.testing.assert_array_equal(out0.tensors["mask"], mask0)
        assert out0.tensors["h"].dtype == np.float32 and out0.tensors["h"].shape == (1, 3, 8)
        assert [hidden[mb]["micro_batch"] for mb in range(4)] == [0, 1, 2, 3]

        assert [c["window"] for c in commits] == [0, 1] and [c["step"] for c in commits] == [1, 2]
        # the stage told its upstream (the feed) too, on the link: windows <= 1 are durably used
        _wait("CHECKPOINT_COMMITTED on the link", lambda: feed.downstream_committed == 1)
        assert feed.buffered() == [0, 1, 2, 3]  # the host's feed keeps its inputs (no pruning)
        telemetry = _of(seen, MsgType.TELEMETRY)
        assert all(t["kind"] in ("micro_batch", "window") for t in telemetry)  # kind is sent on every record
        assert telemetry and telemetry[0]["stage"] == 0 and "task_loss" in telemetry[0].meta
        assert all(isinstance(t["pss_bytes"], int) for t in telemetry)

        send_message(s, Message(MsgType.STATE_GET, {"request_id": 9, "kind": "optimizer"}))
        st = _recv_until(s, MsgType.STATE_PUT, [])
        assert st["request_id"] == 9 and st["step"] == 2
        assert set(st.tensors) == {"exp_avg/a", "exp_avg_sq/a", "exp_avg/b", "exp_avg_sq/b"}

        # hidden states never travel on the host session (as with zl-phone)
        send_message(s, Message(MsgType.HIDDEN_STATE, {"micro_batch": 9, "window": 4}, {"h": h0}))
        err = recv_message(s)
        assert err.type == MsgType.ERROR and err["code"] == "UNEXPECTED"
    feed.close()
    collector.close()


def test_killed_kotlin_stage_resumes_from_its_checkpoint_and_gets_its_gap(classpath, tmp_path):
    """A Python upstream link (pruning on commit) feeds a Kotlin stage; the Kotlin device is killed
    mid-window and restarted on the same storage: it resumes after its last committed window, asks
    for exactly its gap, and applies every window once."""
    token, feed_token = new_token(), new_token()
    errors: list[str] = []
    up = OutboundLink("stage0-out", feed_token, window_size=2, replay_horizon=16, on_error=errors.append)

    def h(mb: int) -> Message:
        return Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // 2},
                       {"h": np.full((1, 2, 4), 0.1 * (mb + 1), dtype=np.float32)})

    dev = KotlinDevice(classpath, tmp_path, token)
    try:
        with dev.connect() as s:
            _assign_and_feed(s, token, 1, feed_token, up)
            for mb in range(5):
                up.publish(h(mb))
            seen: list[Message] = []
            _recv_while(s, seen, lambda: len(_telemetry(seen)) < 5)
            assert [c["window"] for c in _of(seen, MsgType.CHECKPOINT_COMMITTED)] == [0, 1]
            _wait("pruning on commit", lambda: up.buffered() == [4])
        dev.kill()  # micro-batch 4 was accumulated, never committed
    finally:
        dev.close()

    dev = KotlinDevice(classpath, tmp_path, token)
    try:
        with dev.connect() as s:
            ack = _assign_and_feed(s, token, 2, feed_token, up)
            assert ack["committed_window"] == 1 and ack["next_micro_batch"] == 4, ack
            for mb in range(5, 8):
                up.publish(h(mb))
            seen = []
            _recv_while(s, seen, lambda: len(_of(seen, MsgType.CHECKPOINT_COMMITTED)) < 2
                        or len(_telemetry(seen)) < 4)
            assert [c["window"] for c in _of(seen, MsgType.CHECKPOINT_COMMITTED)] == [2, 3]
            assert [t["micro_batch"] for t in _telemetry(seen)] == [4, 5, 6, 7]  # exactly the gap
            assert [t["window"] for t in _telemetry(seen, "window")] == [2, 3]
            send_message(s, Message(MsgType.STATE_GET, {"request_id": 3, "kind": "lora"}))
            st = _recv_until(s, MsgType.STATE_PUT, [])
            assert st["step"] == 4  # four windows, each applied once
        assert errors == []
    finally:
        up.close()
        dev.close()


def _vmhwm_available() -> bool:
    try:
        return "VmHWM:" in Path("/proc/self/status").read_text()
    except OSError:
        return False


def test_kotlin_window_telemetry_sums_up_its_micro_batches(device):
    """The Kotlin stage's per-window TELEMETRY records, checked as
    tests/test_pipeline.py::test_window_telemetry_sums_up_its_micro_batches checks zl_mobile's:
    one per window, right before its CHECKPOINT_COMMITTED, with the window's mean losses over its
    micro-batches, its phase times, and deltas that add up to the running totals."""
    W, windows = 2, 3
    feed_token, out_token = new_token(), new_token()
    out_queue = InboundQueue()
    collector = InboundLink("collector", out_token, out_queue, inflight_depth=8,
                            next_needed=lambda: out_queue.next_after(0), port=0, bind="127.0.0.1")
    feed = OutboundLink("host-feed", feed_token, window_size=W, replay_horizon=16, prune_on_commit=False)
    fed_bytes = 0
    try:
        with device.connect() as s:
            host_handshake(s, device.token)
            send_message(s, _assign(5, feed_token, window_size=W, downstream=f"127.0.0.1:{collector.port}",
                                    downstream_token=out_token))
            ack = recv_message(s)
            assert ack.type == MsgType.ACK and ack["ok"] is True, ack
            feed.set_address(f"127.0.0.1:{ack['data_port']}")
            rng = np.random.default_rng(3)
            seen: list[Message] = []
            for w in range(windows):
                for mb in range(w * W, (w + 1) * W):
                    h = rng.standard_normal((1, 4, 8)).astype(np.float32)
                    fed_bytes += h.nbytes
                    feed.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": w}, {"h": h}))
                _recv_while(s, seen, lambda: len(_of(seen, MsgType.CHECKPOINT_COMMITTED)) <= w)
                if w == 0:
                    # h_k leaves on the link's own thread: let window 0's frames reach the collector (and
                    # the sender count them) before window 1 starts, so later records must show them
                    _wait("window 0's h_k at the collector", lambda: out_queue.next_after(0) >= W)
                    time.sleep(0.3)
    finally:
        feed.close()
        collector.close()

    records = [m.meta for m in _of(seen, MsgType.TELEMETRY)]
    assert all(r["kind"] in ("micro_batch", "window") for r in records)
    mbs = [r for r in records if r["kind"] == "micro_batch"]
    wins = [r for r in records if r["kind"] == "window"]
    assert [r["micro_batch"] for r in mbs] == list(range(W * windows))
    assert sorted((r["stage"], r["window"]) for r in wins) == [(0, w) for w in range(windows)]
    pos = {id(m): i for i, m in enumerate(seen)}
    commit_at = {m["window"]: pos[id(m)] for m in _of(seen, MsgType.CHECKPOINT_COMMITTED)}
    for m in _telemetry(seen, "window"):  # after the window's micro-batches, right before its commit
        w = m["window"]
        assert pos[id(m)] + 1 == commit_at[w], f"window {w}'s record does not directly precede its CHECKPOINT_COMMITTED"
        assert all(pos[id(x)] < pos[id(m)] for x in _telemetry(seen) if x["window"] == w)
        assert all(pos[id(x)] > commit_at[w] for x in _telemetry(seen) if x["window"] > w)
    hwm = _vmhwm_available()
    for wr in wins:
        mine = [r for r in mbs if (r["stage"], r["window"]) == (wr["stage"], wr["window"])]
        assert wr["micro_batches"] == len(mine) == W
        for key in ("task_loss", "consis_loss", "loss"):
            assert wr[key] == pytest.approx(np.mean([r[key] for r in mine]), rel=1e-6, abs=1e-12)
        assert wr["phase1_s"] == pytest.approx(sum(r["phase1_end"] - r["phase1_start"] for r in mine), abs=1e-6)
        assert wr["phase2_s"] == pytest.approx(sum(r["phase2_end"] - r["phase2_start"] for r in mine), abs=1e-3)
        assert wr["step"] == wr["window"] + 1 and all(r["step"] == wr["window"] for r in mine)
        assert 0 < wr["active_s"] <= wr["seconds"] + 1e-3 and wr["step_s"] > 0
        assert wr["schedule"] == "zerolock" and isinstance(wr["pss_bytes"], int)
        assert "temperature_c" not in wr  # the JVM device has no thermometer: left out, never invented
        if hwm:  # the kernel's VmHWM, read and reset through /proc/self
            assert wr["rss_peak_bytes"] >= max(r["rss_peak_bytes"] for r in mine) > 0
        else:
            assert "rss_peak_bytes" not in wr and all("rss_peak_bytes" not in r for r in mine)
    # per-window traffic adds up to the running totals the micro-batch records carry
    assert sum(r["bytes_in"] for r in wins) == max(r["bytes_in"] for r in mbs) == fed_bytes
    # h_k leaves on the link's own thread, so the last window may close before its last frame is out
    assert 0 < min(r["bytes_out"] for r in mbs if r["window"] > 0)
    assert max(r["bytes_out"] for r in mbs) <= sum(r["bytes_out"] for r in wins)
    # active and waiting time within the windows add up to the running totals too
    assert sum(r["wait_s"] for r in wins) == pytest.approx(mbs[-1]["wait_s"], abs=1e-6)
    assert sum(r["active_s"] for r in wins) == pytest.approx(mbs[-1]["active_s"] + wins[-1]["step_s"], abs=1e-6)


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


def _assign_and_feed(s, token: str, request_id: int, feed_token: str, up: OutboundLink) -> Message:
    """Pair, assign the stage, and point the upstream link at the stage's data port."""
    host_handshake(s, token)
    send_message(s, _assign(request_id, feed_token))
    ack = recv_message(s)
    up.set_address(f"127.0.0.1:{ack['data_port']}")
    return ack
