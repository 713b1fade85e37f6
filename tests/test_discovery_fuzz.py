"""Hypothesis fuzzing of discovery's parsing (zl_mobile/mdns.py), beside the frame fuzzers of
tests/test_protocol_fuzz.py. Properties: a TXT record of any keys and bytes is checked without an
exception, and what it accepts is what docs/PROTOCOL.md 10.3 allows (and advertises back the same);
instance-name checking agrees with a plain statement of the rule and escaping round-trips; the
relabelling of outgoing mDNS packets never raises, keeps any packet it does not understand as it
was, and leaves zeroconf's reading of the names unchanged while making each instance one label.

Seeds: the TXT records of tests/vectors/mdns/mdns.json, and packets python-zeroconf writes."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from zl_mobile.mdns import (
    MAX_LABEL_BYTES,
    OPTIONAL_KEYS,
    PROTO,
    REQUIRED_KEYS,
    SERVICE_TYPE,
    check_txt,
    escape_instance,
    found_from,
    instance_name_problem,
    one_label_instances,
    renamed,
    txt_record,
    unescape_instance,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "mdns" / "mdns.json").read_text())
SEED_TXT = [{k.encode(): (None if v is None else v.encode()) for k, v in c["txt"].items()} for c in VECTORS["txt"]]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STATUSES = {"ok", "invalid", "incompatible"}

any_text = st.text(st.characters(blacklist_categories=()), max_size=80)  # surrogates and controls too
keys = st.one_of(st.sampled_from([*REQUIRED_KEYS, *OPTIONAL_KEYS, "NAME", "Mem", "x"]), st.text(max_size=12))
values = st.one_of(st.none(), st.binary(max_size=40),
                   st.sampled_from([b"1", b"0", b"8GB", b"-1", b"0.5", b"nan", b"1e3", b"", b"\xff", b"9" * 20]))


def valid_instance(s: str) -> bool:
    """docs/PROTOCOL.md 10.2 said plainly: 1-63 bytes of UTF-8, no C0 control character nor DEL."""
    try:
        n = len(s.encode("utf-8"))
    except UnicodeEncodeError:
        return False
    return 1 <= n <= MAX_LABEL_BYTES and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in s)


def check_is_consistent(chk):
    assert chk.status in STATUSES
    assert set(chk.problems) <= {*REQUIRED_KEYS, *OPTIONAL_KEYS}
    assert all(isinstance(m, str) and m and "\n" not in m for m in chk.problems.values())
    assert (chk.status == "ok") == (not chk.problems)
    if chk.status == "incompatible":
        assert chk.proto is not None and chk.proto != PROTO and set(chk.problems) == {"proto"}
    if chk.status == "ok":
        assert chk.proto == PROTO and valid_instance(chk.name) and chk.runtime
        assert isinstance(chk.memory_bytes, int) and 0 <= chk.memory_bytes < 2**63
        assert chk.cpu_share is None or (math.isfinite(chk.cpu_share) and 0 < chk.cpu_share <= 1024)


# ---- TXT records -----------------------------------------------------------------------------

@FUZZ
@given(st.dictionaries(st.one_of(keys.map(str.encode), st.binary(max_size=8)), values, max_size=8))
@example({})
@example({b"mem": b"8GB", b"name": b"x", b"proto": b"2", b"runtime": b"r"})
def test_any_txt_record_is_checked_without_an_exception(props):
    check_is_consistent(check_txt(props))


@FUZZ
@given(st.sampled_from(SEED_TXT), st.sampled_from([*REQUIRED_KEYS, *OPTIONAL_KEYS]), values)
def test_one_key_of_a_real_record_changed(props, key, value):
    props = {k: v for k, v in props.items() if k.lower() != key.encode()}  # keys are case-insensitive
    props[key.encode()] = value
    chk = check_txt(props)
    check_is_consistent(chk)
    if key == "mem" and chk.status == "ok":  # what it accepted is what the spec allows
        assert value.isdigit() and value.isascii() and int(value) == chk.memory_bytes


@FUZZ
@given(st.text(min_size=1, max_size=63).filter(valid_instance), st.integers(0, 2**63 - 1),
       st.text(min_size=1, max_size=40).filter(lambda r: valid_instance(r)),
       st.one_of(st.none(), st.floats(min_value=1e-9, max_value=1024), st.sampled_from([1e-5, 0.5, 4.0, 1024.0])))
def test_what_a_phone_advertises_reads_back_the_same(name, mem, runtime, share):
    txt = txt_record(name, 2, runtime, mem, cpu_share=share)
    chk = check_txt({k.encode(): v.encode() for k, v in txt.items()})
    assert chk.status == "ok", chk
    assert (chk.name, chk.runtime, chk.memory_bytes) == (name, runtime, mem)
    assert (chk.cpu_share is None) == (share is None)
    assert share is None or abs(chk.cpu_share - share) <= 1e-9, (txt, chk.cpu_share)


@FUZZ
@given(st.text(max_size=20), st.integers(0, 70000), st.lists(st.text(max_size=16), max_size=3),
       st.dictionaries(st.binary(max_size=8), values, max_size=6))
def test_a_browsed_service_never_raises(instance, port, addresses, props):
    f = found_from(f"{instance}.{SERVICE_TYPE}", port, addresses, props)
    assert f.status in STATUSES and (f.status == "ok") == (not f.problem)
    assert f.instance == instance


# ---- instance names --------------------------------------------------------------------------

@FUZZ
@given(any_text)
@example("Dr. Who's phone")
@example("\\.")
@example("\ud800")
@example("a" * 63)
def test_instance_name_rule(s):
    problem = instance_name_problem(s)
    assert (problem is None) == valid_instance(s), (s, problem)
    if problem is None:
        assert unescape_instance(escape_instance(s)) == s
        esc = escape_instance(s)  # no unescaped dot is left to be taken for a label separator
        assert "." not in esc.replace("\\\\", "").replace("\\.", "")


@FUZZ
@given(st.text(min_size=1, max_size=63).filter(valid_instance), st.integers(2, 10**6))
def test_a_renamed_name_is_still_one_label(base, n):
    r = renamed(base, n)
    assert valid_instance(r) and r.endswith(f" ({n})")
    assert base.startswith(r[: -len(f" ({n})")])


# ---- relabelling outgoing packets ------------------------------------------------------------

def _zeroconf_packet(instances: list[str]) -> bytes:
    from zeroconf import DNSOutgoing, DNSPointer, DNSQuestion, DNSService, DNSText, const

    out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
    out.add_question(DNSQuestion(SERVICE_TYPE, const._TYPE_PTR, const._CLASS_IN))
    for i, inst in enumerate(instances):
        full = f"{inst}.{SERVICE_TYPE}"
        out.add_answer_at_time(DNSPointer(SERVICE_TYPE, const._TYPE_PTR, const._CLASS_IN, 120, full), 0)
        out.add_answer_at_time(DNSService(full, const._TYPE_SRV, const._CLASS_IN, 120, 0, 0, 4000 + i, f"h{i}.local."), 0)
        out.add_answer_at_time(DNSText(full, const._TYPE_TXT, const._CLASS_IN, 120, b"\x06name=x"), 0)
    return out.packets()[0]


def _labels(buf: bytes, off: int) -> tuple[list[bytes], int]:
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


instance_names = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=30).filter(
    lambda s: valid_instance(s) and not s.startswith("_") and ".." not in s and not s.startswith(".")
    and not s.endswith("."))


@FUZZ
@given(st.lists(instance_names, min_size=1, max_size=4, unique_by=str.lower))
@example(["Dr. Who's phone"])
@example(["a.b.c", "a"])
def test_relabelled_packets_read_the_same_with_one_label_instances(instances):
    from zeroconf import DNSIncoming

    packet = _zeroconf_packet(instances)
    fixed = one_label_instances(packet)
    before, after = DNSIncoming(packet), DNSIncoming(fixed)
    assert after.valid
    assert [(a.name, a.type, getattr(a, "alias", None), getattr(a, "port", None)) for a in after.answers()] == \
           [(a.name, a.type, getattr(a, "alias", None), getattr(a, "port", None)) for a in before.answers()]
    # every PTR now points at <one label>._zerolock._tcp.local
    assert _ptr_targets(fixed) == [[i.encode(), b"_zerolock", b"_tcp", b"local"] for i in instances]


SEED_PACKETS = [_zeroconf_packet(["Dr. Who's phone", "p0"]), _zeroconf_packet(["a.b.c"])]


@FUZZ
@given(st.sampled_from(SEED_PACKETS), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6),
       st.integers(0, 400))
def test_relabelling_a_damaged_packet_never_raises(packet, edits, cut):
    data = bytearray(packet)
    for pos, val in edits:
        if pos < len(data):
            data[pos] = val
    data = bytes(data[: max(cut, 12)])
    out = one_label_instances(data)
    assert isinstance(out, bytes)


@FUZZ
@given(st.binary(max_size=300))
@example(b"\x00" * 12)
@example(b"\x00" * 4 + b"\x00\x01" + b"\x00" * 6 + b"\xc0\x0c")  # a name pointing at itself
def test_relabelling_random_bytes_never_raises(data):
    assert isinstance(one_label_instances(data), bytes)
