"""Discovery with odd phones on the network (issue 21), with real zeroconf on both sides: fake
services published with zeroconf itself (as avahi-publish would), zl_mobile.mdns advertisements,
and a real zl-phone process. Every service a test publishes carries a tag unique to this run, and
every assertion filters by it: other phones may be advertising on the same machine."""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from zl_mobile.mdns import SERVICE_TYPE, Advertisement, _zeroconf, advertised_addresses, browse, one_label_instances, txt_record
from zl_mobile.protocol import host_handshake, new_token

TAG = f"t{os.getpid()}{secrets.token_hex(2)}"
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
GOOD = {"proto": "2", "runtime": "fake/zeroconf", "mem": "1073741824"}


def mine(found, prefix=TAG):
    return [f for f in found if f.name.startswith(prefix) or f.instance.startswith(prefix)]


@pytest.fixture
def publisher():
    """Publish raw services with a plain python-zeroconf (no zl_mobile code), like avahi-publish."""
    from zeroconf import IPVersion, ServiceInfo, Zeroconf

    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    infos = []

    def publish(instance: str, port: int, props: dict):
        info = ServiceInfo(SERVICE_TYPE, f"{instance}.{SERVICE_TYPE}", addresses=[socket.inet_aton("127.0.0.1")],
                           port=port, properties=props, server=f"fake-{TAG}-{port}.local.")
        zc.register_service(info, cooperating_responders=True)  # no probing: quick
        infos.append(info)

    yield publish
    for info in infos:
        zc.unregister_service(info)
    zc.close()


# ---------------------------------------------------------------- bad TXT records
def test_bad_txt_records_are_listed_with_the_reason_never_a_crash(publisher, capsys):
    from host.cli.zl_host import main

    publisher(f"{TAG}-mem", 40001, {"name": f"{TAG}-mem", **GOOD, "mem": "8GB"})
    publisher(f"{TAG}-nomem", 40002, {"name": f"{TAG}-nomem", "proto": "2", "runtime": "fake/zeroconf"})
    publisher(f"{TAG}-proto2", 40003, {"name": f"{TAG}-proto2", **GOOD, "proto": "1"})  # an unsealed (old) phone
    publisher(f"{TAG}-ok", 40004, {"name": f"{TAG}-ok", **GOOD})
    assert main(["devices", "--timeout", "3", "--mdns", "127.0.0.1"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith(TAG)}
    assert set(rows) == {f"{TAG}-mem", f"{TAG}-nomem", f"{TAG}-proto2", f"{TAG}-ok"}, rows
    assert "invalid: mem '8GB' is not a whole number of bytes" in rows[f"{TAG}-mem"]
    assert "invalid: mem is missing" in rows[f"{TAG}-nomem"]
    assert "incompatible: proto 1 is not this host's protocol version 2" in rows[f"{TAG}-proto2"]
    assert re.search(r"127\.0\.0\.1:40004 +proto 2 .* 1\.0 GiB", rows[f"{TAG}-ok"]), rows[f"{TAG}-ok"]

    assert main(["devices", "--timeout", "3", "--mdns", "127.0.0.1", "--json"]) == 0
    listed = {d["name"]: d for d in json.loads(capsys.readouterr().out) if d["name"].startswith(TAG)}
    assert {n: d["status"] for n, d in listed.items()} == {
        f"{TAG}-mem": "invalid", f"{TAG}-nomem": "invalid", f"{TAG}-proto2": "incompatible", f"{TAG}-ok": "ok"}


def test_run_devices_uses_only_valid_phones_and_says_what_it_skipped(publisher, capsys):
    from host.devices.discovery import DeviceLookupError, resolve

    publisher(f"{TAG}-bad", 40011, {"name": f"{TAG}-bad", **GOOD, "mem": "8GB"})
    publisher(f"{TAG}-good", 40012, {"name": f"{TAG}-good", **GOOD})
    tokens = {f"{TAG}-bad": new_token(), f"{TAG}-good": new_token()}
    handles = resolve("auto", 1, tokens, wait_s=30, interfaces="127.0.0.1")
    assert [(h.name, h.endpoint) for h in handles] == [(f"{TAG}-good", "127.0.0.1:40012")]
    # a service that did not get in the way of a quick choice may not have been resolved yet; by name it is
    with pytest.raises(DeviceLookupError) as e:
        resolve(f"{TAG}-bad", 1, tokens, wait_s=10, interfaces="127.0.0.1")
    msg = str(e.value)
    assert "\n" not in msg and f"{TAG}-bad at 127.0.0.1:40011 advertises an invalid TXT record" in msg
    assert "mem '8GB' is not a whole number of bytes" in msg and "docs/PROTOCOL.md 10.3" in msg
    err = capsys.readouterr().err
    assert f"zl-host: warning: skipped '{TAG}-bad' at 127.0.0.1:40011: invalid TXT record (mem '8GB'" in err


# ---------------------------------------------------------------- one label on the wire
def _labels(buf: bytes, off: int) -> tuple[list[bytes], int]:
    """A DNS name at `off` as its labels (a reader independent of zl_mobile.mdns)."""
    out, end = [], None
    while buf[off]:
        if buf[off] >= 0xC0:
            end = end or off + 2
            off = struct.unpack("!H", buf[off:off + 2])[0] & 0x3FFF
            continue
        out.append(buf[off + 1: off + 1 + buf[off]])
        off += 1 + buf[off]
    return out, end or off + 1


def _ptr_targets(packet: bytes) -> list[list[bytes]]:
    qd, an, ns, ar = struct.unpack("!4H", packet[4:12])
    off, out = 12, []
    for _ in range(qd):
        off = _labels(packet, off)[1] + 4
    for _ in range(an + ns + ar):
        off = _labels(packet, off)[1]
        rtype, _, _, rdlen = struct.unpack("!HHIH", packet[off:off + 10])
        if rtype == 12:
            out.append(_labels(packet, off + 10)[0])
        off += 10 + rdlen
    return out


class Sniffer:
    """Every mDNS packet multicast on loopback while it runs (one more socket on port 5353)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.sock.bind(("224.0.0.251", 5353))
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                             socket.inet_aton("224.0.0.251") + socket.inet_aton("127.0.0.1"))
        self.sock.settimeout(0.2)
        self.packets: list[bytes] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            try:
                self.packets.append(self.sock.recv(9000))
            except socket.timeout:
                pass

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close()


def test_a_dotted_unicode_name_goes_out_as_one_dns_label():
    name = f"Dr. Who's phone {TAG} \u96fb\u8a71"
    sniff = Sniffer()
    try:
        ad = Advertisement(name, 40021, txt_record(name, 2, "fake/x", 5))
        try:
            assert ad.instance == f"{name}.{SERVICE_TYPE}" and not ad.renamed
            assert ad.presentation == f"Dr\\. Who's phone {TAG} \u96fb\u8a71._zerolock._tcp.local."
            found = mine(browse(timeout=5, until=lambda fs: any(f.port == 40021 for f in fs)), "Dr. Who")
            assert [(f.name, f.instance, f.endpoint, f.status) for f in found] == [
                (name, name, "127.0.0.1:40021", "ok")]
        finally:
            ad.close()
    finally:
        sniff.close()
    targets = [t for p in sniff.packets for t in _ptr_targets(p) if TAG.encode() in b"".join(t)]
    assert targets, "no PTR record for the service was seen on the wire"
    for t in targets:  # the announcements and the goodbye: <one label>._zerolock._tcp.local
        assert t == [name.encode(), b"_zerolock", b"_tcp", b"local"], t


def test_relabelling_touches_only_instance_names_of_our_service():
    from zeroconf import DNSOutgoing, DNSPointer, DNSQuestion, const

    out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
    out.add_question(DNSQuestion("a.b._zerolock._tcp.local.", const._TYPE_SRV, const._CLASS_IN))
    out.add_answer_at_time(DNSPointer(SERVICE_TYPE, const._TYPE_PTR, const._CLASS_IN, 120, "a.b._zerolock._tcp.local."), 0)
    out.add_answer_at_time(DNSPointer("_http._tcp.local.", const._TYPE_PTR, const._CLASS_IN, 120, "x.y._http._tcp.local."), 0)
    out.add_answer_at_time(
        DNSPointer("_zerolock._tcp.local.", const._TYPE_PTR, const._CLASS_IN, 120, "s._sub._zerolock._tcp.local."), 0)
    (packet,) = out.packets()
    fixed = one_label_instances(packet)
    assert _labels(packet, 12)[0] == [b"a", b"b", b"_zerolock", b"_tcp", b"local"]  # what zeroconf writes
    assert _labels(fixed, 12)[0] == [b"a.b", b"_zerolock", b"_tcp", b"local"]
    assert _ptr_targets(fixed) == [[b"a.b", b"_zerolock", b"_tcp", b"local"],
                                   [b"x", b"y", b"_http", b"_tcp", b"local"],  # not ours: as it was
                                   [b"s", b"_sub", b"_zerolock", b"_tcp", b"local"]]  # a subtype: as it was
    from zeroconf import DNSIncoming

    msg = DNSIncoming(fixed)
    assert msg.valid and [a.alias for a in msg.answers()][0] == "a.b._zerolock._tcp.local."
    assert one_label_instances(b"\x00" * 5) == b"\x00" * 5  # not a DNS message: left alone


# ---------------------------------------------------------------- conflicts and namesakes
def test_a_taken_name_is_renamed_and_namesakes_are_refused_by_name(capsys):
    from host.devices.discovery import DeviceLookupError, resolve

    name = f"{TAG}-twin"
    first = Advertisement(name, 40031, txt_record(name, 2, "fake/x", 5))
    try:
        second = Advertisement(name, 40032, txt_record(name, 2, "fake/x", 5))  # another zeroconf, same name
        try:
            assert (first.instance_label, first.renamed) == (name, False)
            assert (second.instance_label, second.renamed) == (f"{name} (2)", True)
            tokens = {name: new_token()}
            with pytest.raises(DeviceLookupError) as e:
                resolve(name, 1, tokens, wait_s=10, interfaces="127.0.0.1")
            msg = str(e.value)
            assert "\n" not in msg and f"2 devices are named '{name}'" in msg
            assert "127.0.0.1:40031" in msg and "127.0.0.1:40032" in msg and "ADDRESS:PORT" in msg and "serial" in msg
            (h,) = resolve("127.0.0.1:40032", 1, tokens, wait_s=30, interfaces="127.0.0.1")
            assert (h.name, h.endpoint, h.token) == (name, "127.0.0.1:40032", tokens[name])
            (h,) = resolve(f"{name} (2)", 1, tokens, wait_s=30, interfaces="127.0.0.1")  # its instance name
            assert h.endpoint == "127.0.0.1:40032"
            with pytest.raises(DeviceLookupError) as e:  # auto does not guess between them either
                resolve("auto", 1, tokens, wait_s=6, interfaces="127.0.0.1")
            assert f"left out, named alike: {name}" in str(e.value)
        finally:
            second.close()
    finally:
        first.close()


def test_two_phones_claiming_one_name_at_once_end_up_with_two_names():
    name = f"{TAG}-race"
    ads, errors = {}, []

    def advertise(port):
        try:
            ads[port] = Advertisement(name, port, txt_record(name, 2, "fake/x", 5))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=advertise, args=(p,)) for p in (40041, 40042)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        # both may have claimed it in the same instant (a loaded machine): then the announcement
        # check (RFC 6762 9) renames one of them a moment later
        deadline = time.monotonic() + 15
        while len({a.instance_label for a in ads.values()}) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(a.instance_label for a in ads.values()) == [name, f"{name} (2)"]
        found = mine(browse(timeout=6, until=lambda fs: len(mine(fs, name)) >= 2), name)
        assert sorted((f.instance, f.port) for f in found) == sorted((a.instance_label, p) for p, a in ads.items())
    finally:
        for a in ads.values():
            a.close()


def test_two_claims_of_one_name_seen_after_announcing_leave_exactly_one_renamed():
    """RFC 6762 9: two devices that claimed one name without hearing each other (here: without
    asking first) meet in each other's announcements; the one whose SRV data sorts lower renames."""
    name = f"{TAG}-clash"
    renames = []
    done = threading.Event()

    def on_rename(label):
        renames.append(label)
        done.set()

    a = Advertisement(name, 40051, txt_record(name, 2, "fake/x", 5), probe=False, on_rename=on_rename)
    try:
        b = Advertisement(name, 40052, txt_record(name, 2, "fake/x", 5), probe=False, on_rename=on_rename)
        try:
            # both claimed it (neither asked first); one may give way while b is still announcing
            assert done.wait(10), "neither device gave way"
            assert renames == [f"{name} (2)"]
            loser, winner = (a, b) if (a.info.port, a.info.server) < (b.info.port, b.info.server) else (b, a)
            assert (loser.instance_label, winner.instance_label) == (f"{name} (2)", name)
            found = mine(browse(timeout=6, until=lambda fs: len(mine(fs, name)) >= 2), name)
            assert sorted((f.instance, f.port) for f in found) == sorted(
                [(name, winner.port), (f"{name} (2)", loser.port)])
        finally:
            b.close()
    finally:
        a.close()
    assert renames == [f"{name} (2)"]  # and nobody moved again


# ---------------------------------------------------------------- names the phone refuses
@pytest.mark.parametrize("bad,why", [("x" * 64, "is 64 bytes in UTF-8; an mDNS instance name is at most 63"),
                                     ("\u96fb" * 22, "is 66 bytes in UTF-8"),
                                     ("tab\there", "contains the control character '\\t'"),
                                     ("", "is empty")])
def test_phone_refuses_a_name_that_is_not_one_label(tmp_path, capsys, bad, why):
    from zl_mobile import phone

    assert phone.main(["--name", bad, "--workdir", str(tmp_path / "w"), "--mdns", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("zl-phone: error: --name:") and why in err, err
    assert "use a shorter name" in err
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- addresses
def test_advertised_addresses_follow_the_bind():
    assert advertised_addresses("127.0.0.1", "loopback") == ["127.0.0.1"]
    assert advertised_addresses("192.0.2.7", "all") == ["192.0.2.7"]
    assert advertised_addresses("0.0.0.0", "loopback") == ["127.0.0.1"]
    assert advertised_addresses("0.0.0.0", "10.1.2.3") == ["10.1.2.3"]
    lan = advertised_addresses("0.0.0.0", "all")
    routed = _routed_address()
    if routed is None:  # a machine with no route anywhere: loopback is all a peer could use
        assert lan == ["127.0.0.1"]
    else:
        assert routed in lan and not any(a.startswith("127.") for a in lan), (routed, lan)


def _routed_address() -> str | None:
    """The source address the kernel picks for an outside destination (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        a = s.getsockname()[0]
        return None if a.startswith("127.") else a


# ---------------------------------------------------------------- a real phone: LAN address, goodbye on SIGTERM
class Watcher:
    """A zeroconf ServiceBrowser noting when services with the tag appear and disappear."""

    def __init__(self, interfaces):
        from zeroconf import ServiceBrowser

        self.zc = _zeroconf(interfaces)
        self.added, self.removed = threading.Event(), threading.Event()
        watcher = self

        class L:
            def add_service(self, zc, type_, name):
                if TAG in name:
                    watcher.added.set()

            def remove_service(self, zc, type_, name):
                if TAG in name:
                    watcher.removed.set()

            def update_service(self, *a):
                pass

        self.browser = ServiceBrowser(self.zc, SERVICE_TYPE, L())

    def close(self):
        self.browser.cancel()
        self.zc.close()


def test_phone_on_0_0_0_0_advertises_its_lan_address_and_says_goodbye_on_sigterm(tmp_path):
    routed = _routed_address()
    mdns = "all" if routed else "loopback"
    name = f"Dr. Who's phone {TAG}"
    token = new_token()
    watcher = Watcher("all" if routed else ["127.0.0.1"])
    proc = subprocess.Popen([sys.executable, "-m", "zl_mobile.phone", "--name", name, "--workdir", str(tmp_path / "w"),
                             "--token", token, "--bind", "0.0.0.0", "--mdns", mdns, "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("advertised"):
                break
        assert lines and lines[-1].startswith("advertised"), (lines, proc.stderr.read() if proc.poll() is not None else "")
        port = int(re.search(r"listening on 0\.0\.0\.0:(\d+),", "\n".join(lines)).group(1))
        expect = routed or "127.0.0.1"
        assert lines[-1].startswith(f"advertised as Dr\\. Who's phone {TAG}._zerolock._tcp.local. on {mdns} at ")
        assert expect in lines[-1].split(" at ", 1)[1].split(", ")
        found = [f for f in browse(timeout=8, interfaces="all" if routed else ["127.0.0.1"],
                                   until=lambda fs: any(f.port == port and f.name == name for f in fs))
                 if f.port == port and f.name == name]
        assert len(found) == 1 and found[0].instance == name, found
        assert expect in found[0].addresses and (routed is None or "127.0.0.1" not in found[0].addresses)
        with socket.create_connection((found[0].address, port), timeout=10) as sock:  # a peer reaches it there
            sock.settimeout(10)
            assert host_handshake(sock, token)["name"] == name
        assert watcher.added.wait(10)
        proc.send_signal(signal.SIGTERM)  # how zl-host emulate stops a phone
        assert proc.wait(timeout=20) == 0
        # the goodbye (TTL 0) removes it from every cache at once; without it, it would stay for the TTL (120 s+)
        assert watcher.removed.wait(10), "no mDNS goodbye seen after SIGTERM"
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        watcher.close()


def _start_phone(tmp_path, name, *args):
    proc = subprocess.Popen([sys.executable, "-m", "zl_mobile.phone", "--name", name, "--workdir", str(tmp_path),
                             "--token", new_token(), "--threads", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("advertised"):
            break
    return proc, lines


def test_two_zl_phones_with_one_name_both_reachable(tmp_path):
    name = f"{TAG}-same"
    procs = []
    try:
        for i in range(2):
            proc, lines = _start_phone(tmp_path / f"w{i}", name)
            procs.append(proc)
            assert lines and lines[-1].startswith("advertised"), lines
        assert lines[-1] == (f"advertised as {name} (2)._zerolock._tcp.local. on loopback at 127.0.0.1 "
                             f"(renamed: another device holds '{name}')")
        found = mine(browse(timeout=6, until=lambda fs: len(mine(fs, name)) >= 2), name)
        assert sorted(f.instance for f in found) == [name, f"{name} (2)"] and {f.name for f in found} == {name}
        assert len({f.endpoint for f in found}) == 2
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                assert p.wait(timeout=20) == 0
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
