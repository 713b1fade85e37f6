"""host.phones.netns: emulated phones in their own network namespaces, behind kernel-shaped links.

Needs root and iproute2 with tbf; where the machine cannot make namespaces the benchmarks fall
back to the transport's rate limiter (tested in test_protocol.py), and these tests say why."""
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host.phones import netns
from host.phones.emulated_phone import EmulatedPhone
from host.run.settings import RunSettings
from tests.conftest import run_pipeline, small_micro_batches

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces here: {WHY_NOT}")

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.monotonic(); n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_phone_to_phone_link_runs_at_the_shaped_rate_and_close_removes_everything():
    size, mbit = 3 << 20, 16.0  # 3 MiB at 2 MB/s: about 1.6 s
    with netns.ShapedNetwork(2, mbit) as net:
        a, b = net.phones
        assert a.ns in _namespaces() and a.address != b.address
        rx = subprocess.Popen([*b.prefix, sys.executable, "-c", RECEIVER, b.address], stdout=subprocess.PIPE, text=True)
        port = int(rx.stdout.readline())
        # phone a's upload and phone b's download, across the bridge, as stage-to-stage traffic goes
        tx = subprocess.run([*a.prefix, sys.executable, "-c",
                             f"import socket; c = socket.create_connection(('{b.address}', {port})); "
                             f"c.sendall(b'x' * {size}); c.close()"], capture_output=True, text=True, timeout=60)
        assert tx.returncode == 0, tx.stderr
        n, seconds = rx.stdout.readline().split()
        rx.wait(timeout=10)
        assert int(n) == size
        rate = size * 8 / float(seconds) / 1e6
        assert 0.6 * mbit < rate < 1.1 * mbit, f"{rate:.1f} Mbit/s through a {mbit} Mbit/s link"
        bridge, names = net.bridge, [p.ns for p in net.phones]
    left = _namespaces()
    assert not any(n in left for n in names)
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0


def _json(cmd: list[str], ns: str | None = None):
    import json
    return json.loads(subprocess.run((["ip", "netns", "exec", ns] if ns else []) + cmd, capture_output=True,
                                     text=True, check=True).stdout)


@pytest.mark.parametrize("mbit", [50.0, 100.0, 300.0])
def test_shaped_links_pass_whole_packets(mbit):
    # tbf splits a packet larger than its burst into MTU-sized ones, which then cross both stacks on the
    # sending phone's core (a sending stage's phase 2 ran 25% slower at 50 Mbit/s): the links' packets fit
    with netns.ShapedNetwork(1, mbit) as net:
        ph = net.phones[0]
        for dev, ns in ((ph.host_dev, None), (ph.phone_dev, ph.ns)):
            burst = _json(["tc", "-j", "qdisc", "show", "dev", dev], ns)[0]["options"]["burst"]
            gso = _json(["ip", "-d", "-j", "link", "show", "dev", dev], ns)[0]["gso_max_size"]
            assert gso < burst, (dev, gso, burst)


def test_a_network_whose_owner_was_killed_is_removed_by_the_next_one():
    # a bench killed with SIGKILL cannot close its network; the next one to open sweeps it
    killed = subprocess.run([sys.executable, "-c", "import os; from host.phones import netns; n = netns.ShapedNetwork(1).open(); "
                             "print(n.bridge, n.phones[0].ns, flush=True); os.kill(os.getpid(), 9)"],
                            capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    bridge, ns = killed.stdout.split()
    assert ns in _namespaces()
    with netns.ShapedNetwork(1) as net:
        assert ns not in _namespaces()
        assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
        assert netns.sweep_stale() == []  # a live owner's network stays
        assert net.phones[0].ns in _namespaces()


def test_phones_in_namespaces_train_and_are_not_on_the_hosts_loopback(small_export, tmp_path):
    out, manifest, artifacts, cfg = small_export
    with netns.ShapedNetwork(3, 200.0) as net:
        p = EmulatedPhone("nsprobe", tmp_path / "probe", secrets.token_hex(32), net=net.phones[0]).start()
        try:
            assert p.endpoint == f"{net.phones[0].address}:{p.port}"
            socket.create_connection((p.address, p.port), timeout=5).close()
            with pytest.raises(OSError):  # it listens inside its own namespace, not on the host's loopback
                socket.create_connection(("127.0.0.1", p.port), timeout=2).close()
        finally:
            p.stop()

        settings = RunSettings(windows=3, window_size=2, lr=2e-2, inflight_depth=4)
        result, records = run_pipeline(out, tmp_path / "run", settings, small_micro_batches(out, n_examples=4),
                                       network=net)
    tel = [r for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"]
    for k in range(3):
        losses = {w: np.mean([r["loss"] for r in tel if r["stage"] == k and r["window"] == w]) for w in range(3)}
        assert losses[2] < losses[0], (k, losses)
