"""One mDNS advert whose instance label holds ESC and BEL (issue 51 item 14: PROTOCOL.md 10.2 forbids
it, avahi-publish sends it) beside a valid phone, with real zeroconf on loopback: `zl-host devices`
(plain and --json) and `--devices auto` list the bad one as invalid with its reason, escaped, and
still find the valid one. python-zeroconf refuses to publish such a label, so the advert is sent
as raw multicast DNS records, as another responder would."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from zeroconf import DNSAddress, DNSOutgoing, DNSPointer, DNSService, DNSText, const

from tests.test_discovery import GOOD, TAG, publisher  # noqa: F401  (publisher: a fixture)
from zl_mobile.mdns import SERVICE_TYPE
from zl_mobile.protocol import new_token

BAD_INSTANCE = f"{TAG}-term\x1b]0;pwned\x07"


def _txt(props: dict) -> bytes:
    return b"".join(bytes([len(e)]) + e for e in (f"{k}={v}".encode() for k, v in props.items()))


def _advert(instance: str, port: int, props: dict) -> list[bytes]:
    name, server = f"{instance}.{SERVICE_TYPE}", f"raw-{TAG}-{port}.local."
    out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
    unique = const._CLASS_IN | const._CLASS_UNIQUE
    out.add_answer_at_time(DNSPointer(SERVICE_TYPE, const._TYPE_PTR, const._CLASS_IN, 120, name), 0)
    out.add_answer_at_time(DNSService(name, const._TYPE_SRV, unique, 120, 0, 0, port, server), 0)
    out.add_answer_at_time(DNSText(name, const._TYPE_TXT, unique, 120, _txt(props)), 0)
    out.add_answer_at_time(DNSAddress(server, const._TYPE_A, unique, 120, socket.inet_aton("127.0.0.1")), 0)
    return out.packets()


@pytest.fixture
def bad_advert():
    """The bad advert multicast on loopback every 0.2 s while the test runs."""
    packets = _advert(BAD_INSTANCE, 40021, {"name": f"{TAG}-term", **GOOD})
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))  # not port 5353: zeroconf's own sockets there keep their unicast answers
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    stop = threading.Event()

    def run():
        while not stop.is_set():
            for p in packets:
                sock.sendto(p, ("224.0.0.251", 5353))
            stop.wait(0.2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    yield
    stop.set()
    t.join()
    sock.close()


def _no_raw_controls(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, repr(text)


def test_devices_lists_a_bad_instance_escaped_and_the_valid_phone_beside_it(publisher, bad_advert, capsys):  # noqa: F811
    from host.cli.zl_host import main

    publisher(f"{TAG}-ok", 40022, {"name": f"{TAG}-ok", **GOOD})
    time.sleep(0.5)  # the bad advert is on the wire before the browse starts
    assert main(["devices", "--timeout", "3", "--mdns", "127.0.0.1"]) == 0
    out = capsys.readouterr().out
    _no_raw_controls(out)
    rows = [line for line in out.splitlines() if TAG in line and not line.startswith("looked at")]
    assert any(r.startswith(f"{TAG}-ok ") and "127.0.0.1:40022" in r for r in rows), out
    bad = [r for r in rows if r.startswith(f'"{TAG}-term\\x1b]0;pwned\\x07"')]
    assert len(bad) == 1 and "invalid: instance name contains the control character '\\x1b'" in bad[0], out

    assert main(["devices", "--timeout", "3", "--mdns", "127.0.0.1", "--json"]) == 0
    out = capsys.readouterr().out
    _no_raw_controls(out)
    listed = {d["name"]: d for d in json.loads(out) if TAG in d["name"]}
    assert listed[f"{TAG}-ok"]["status"] == "ok"
    assert listed[f'"{TAG}-term\\x1b]0;pwned\\x07"']["status"] == "invalid", listed


def test_devices_auto_uses_the_valid_phone_despite_a_bad_instance(publisher, bad_advert, capsys):  # noqa: F811
    from host.devices.discovery import resolve

    publisher(f"{TAG}-good", 40023, {"name": f"{TAG}-good", **GOOD})
    time.sleep(0.5)
    handles = resolve("auto", 1, {f"{TAG}-good": new_token()}, wait_s=30, interfaces="127.0.0.1")
    assert [(h.name, h.endpoint) for h in handles] == [(f"{TAG}-good", "127.0.0.1:40023")]
    captured = capsys.readouterr()
    _no_raw_controls(captured.out + captured.err)
