"""Emulated phones on their own network: one Linux network namespace per phone, joined to the
host by a veth pair on a bridge (the "access point"), each direction rate-shaped by the kernel.

    host (root namespace)            bridge zlbr<id>, 10.<net>.0.1/24
      |-- veth h<i>  --tbf rate-->   phone i's download
      `-- veth p<i> (in netns)       phone i at 10.<net>.0.<i+2>, upload shaped by tbf

Phone-to-phone traffic (hidden states downstream, BP gradients upstream) crosses the bridge, so
it pays the sender's upload and the receiver's download like two phones on one Wi-Fi. Needs root
and iproute2 (`ip`, `tc` with tbf); `unavailable()` says why not, and callers fall back to the
transport's own rate limiter. Added latency needs sch_netem, which not every kernel has.

Each open network records its owner's pid (OWNERS/<tag>); a network whose owner died without
closing it (SIGKILL) is removed by the next open() or by sweep_stale()."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from zl_mobile.processes import pid_alive

OWNERS = Path(os.environ.get("ZL_NETNS_OWNERS", "/run/zerolock/netns"))  # tag -> owner pid


class NetnsError(Exception):
    pass


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.stdout.strip()}")


def unavailable() -> str | None:
    """None when this machine can run phones in shaped namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or use the transport's rate limiter)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"zlprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("ip", "netns", "add", probe)
        _ip("ip", "link", "add", "name", "zlva", "type", "veth", "peer", "name", "zlvb", ns=probe)
        _tbf("zlva", 10.0, ns=probe)
    except NetnsError as e:
        return str(e)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _tbf(dev: str, mbit: float, ns: str | None = None) -> None:
    # burst: at least one MTU and ~4 ms of traffic, so the shaper does not starve TCP at high rates;
    # a larger burst would let part of every hidden state through unshaped
    burst = max(32 << 10, int(mbit * 1e6 / 8 * 0.004))
    _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit", "burst", str(burst),
        "latency", "100ms", ns=ns)
    # tbf splits a GSO packet larger than its burst into MTU-sized ones, and every one of those then
    # crosses both stacks and the bridge in softirq on the sending phone's core: measured +12 ms of
    # its core per 512 KiB at 50 Mbit/s, a sending stage's phase 2 +25%. Packets that fit pass whole.
    _ip("ip", "link", "set", "dev", dev, "gso_max_size", str(min(65536, burst * 3 // 4)), ns=ns)



def _bridge_name(tag: str) -> str:
    return f"zlbr{tag}"


def _ns_prefix(tag: str) -> str:
    return f"zl{tag}p"  # phone i's namespace: this + i


def _remove(tag: str, namespaces: list[str]) -> None:
    for ns in namespaces:  # deleting a namespace deletes its veth end, and so the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", _bridge_name(tag)], capture_output=True)
    (OWNERS / tag).unlink(missing_ok=True)


def _namespaces() -> list[str]:
    """The names `ip netns list` shows (each line: NAME [(id: N)])."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove the networks whose owner process is gone without closing them; their tags."""
    if not OWNERS.is_dir():
        return []
    names = _namespaces()
    removed = []
    for rec in OWNERS.iterdir():
        if rec.name.startswith("."):
            continue
        try:
            pid = int(rec.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and pid_alive(pid):
            continue
        _remove(rec.name, [n for n in names if n.startswith(_ns_prefix(rec.name))])
        removed.append(rec.name)
    return removed


@dataclass
class PhoneNet:
    """Phone i's namespace: run its process under `prefix`, bind and reach it at `address`."""
    ns: str
    address: str
    host_dev: str   # the veth end on the bridge (the phone's download is shaped here)
    phone_dev: str  # the veth end in the namespace (its upload)

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


@dataclass
class ShapedNetwork:
    """A bridge and n phone namespaces, each link shaped to `rate_mbit` per direction (None: not
    shaped). Use as a context manager; close() removes everything it made."""
    n: int
    rate_mbit: float | None = None
    phones: list[PhoneNet] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])

    def __post_init__(self):
        if self.n > 250:
            raise NetnsError(f"{self.n} phones do not fit one /24 network")

    @property
    def bridge(self) -> str:
        return _bridge_name(self.tag)

    @property
    def _net(self) -> str:
        """A /24 in 10.200-239.x, picked from the tag so concurrent networks rarely collide."""
        return f"10.{200 + int(self.tag, 16) % 40}.{int(self.tag[:2], 16)}"

    def _phone(self, i: int) -> PhoneNet:
        return PhoneNet(f"{_ns_prefix(self.tag)}{i}", f"{self._net}.{i + 2}", f"zl{self.tag}h{i}", f"zl{self.tag}v{i}")

    @property
    def host_address(self) -> str:
        return f"{self._net}.1"

    def open(self) -> "ShapedNetwork":
        """Callers check unavailable() first (once) to choose between this and the rate limiter."""
        sweep_stale()
        OWNERS.mkdir(parents=True, exist_ok=True)
        tmp = OWNERS / f".{self.tag}"  # written whole, then renamed: a sweep never reads it half-written
        tmp.write_text(str(os.getpid()))
        tmp.replace(OWNERS / self.tag)  # before anything exists, so nothing is left unowned
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            _ip("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("ip", "link", "set", self.bridge, "up")
            for i in range(self.n):
                ph = self._phone(i)
                ns, h, p, addr = ph.ns, ph.host_dev, ph.phone_dev, ph.address
                _ip("ip", "netns", "add", ns)
                self.phones.append(ph)
                _ip("ip", "link", "add", h, "type", "veth", "peer", "name", p)
                _ip("ip", "link", "set", p, "netns", ns)
                _ip("ip", "link", "set", h, "master", self.bridge)
                _ip("ip", "link", "set", h, "up")
                _ip("ip", "addr", "add", f"{addr}/24", "dev", p, ns=ns)
                _ip("ip", "link", "set", p, "up", ns=ns)
                _ip("ip", "link", "set", "lo", "up", ns=ns)
                if self.rate_mbit:
                    _tbf(h, self.rate_mbit)          # into the phone (download)
                    _tbf(p, self.rate_mbit, ns=ns)   # out of the phone (upload)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        _remove(self.tag, [ph.ns for ph in self.phones])
        self.phones = []

    def reopen(self) -> "ShapedNetwork":
        """Take over this tag's network if a previous owner (a killed zl-host) left it whole, so
        its phones stay reachable at the same addresses; else make it anew."""
        existing = _namespaces()
        phones = [self._phone(i) for i in range(self.n)]
        rec = OWNERS / self.tag
        if rec.exists() and all(ph.ns in existing for ph in phones):
            rec.write_text(str(os.getpid()))
            self.phones = phones
            return self
        _remove(self.tag, [ph.ns for ph in phones if ph.ns in existing])
        return self.open()

    def __enter__(self) -> "ShapedNetwork":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
