"""mDNS/DNS-SD: phones advertise `_zerolock._tcp.local.`; the host browses for them.

docs/PROTOCOL.md section 10 is the spec: the service type, the instance name rules and the TXT
keys. This module is the Python side of it (the Kotlin core's `ZeroLockTxt` the other):

* instance names are one DNS label of at most 63 bytes of UTF-8, dots included (RFC 6763 4.1.1);
  python-zeroconf keeps names as dotted strings and splits every dot into a label when it writes
  a packet, so `ZlZeroconf` re-labels names under our service type on their way out;
* a name another responder already answers for is not claimed: the phone asks for it first
  (multicast, so a second responder on the same machine hears the question too), and zeroconf
  probes it again (RFC 6762 8.1); a taken name becomes "NAME (2)", "NAME (3)", ... (the TXT
  `name` stays the phone's own name);
* a TXT record is checked key by key (`check_txt`): a bad or missing field, or another protocol
  version, makes the device `invalid` / `incompatible` with the reason, never an exception.

Emulated phones advertise on loopback by default, so nothing leaves the machine; real
phones (and a host looking for them) use the LAN interfaces."""
from __future__ import annotations

import hashlib
import math
import re
import socket
import threading
import time
import unicodedata
from dataclasses import dataclass, field

from .protocol.quoting import quote

SERVICE_TYPE = "_zerolock._tcp.local."
PROTO = 2  # the wire protocol version this side speaks (docs/PROTOCOL.md; 2 = sealed sessions)
LOOPBACK = ["127.0.0.1"]
MAX_LABEL_BYTES = 63
MAX_RENAMES = 20
# how long a phone listens for another responder's answer before it claims a name: a responder
# multicasts a record at most once a second (RFC 6762 6), so an answer to our question can wait
# up to 1 s behind the announcement it just made; and zeroconf's own probe (QU, RFC 6762 8.1)
# is answered by unicast to port 5353, which on a machine with several responders reaches only
# one of their sockets
PROBE_MS = 1500
CPU_SHARE_MAX = 1024.0
REQUIRED_KEYS = ("name", "proto", "runtime", "mem")
OPTIONAL_KEYS = ("cpu_share",)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DIGITS = re.compile(r"[0-9]{1,19}")
_DECIMAL = re.compile(r"[0-9]{1,6}(\.[0-9]{1,9})?")


class InstanceNameError(ValueError):
    """A device name that cannot be an mDNS instance name (one line, says the fix)."""


class AdvertiseError(RuntimeError):
    pass


# ---------------------------------------------------------------- instance names
def instance_name_problem(name: str) -> str | None:
    """Why `name` cannot be a DNS-SD instance name (one DNS label), or None if it can."""
    if not isinstance(name, str) or not name:
        return "is empty"
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid UTF-8 (a lone surrogate)"
    if n > MAX_LABEL_BYTES:
        return f"is {n} bytes in UTF-8; an mDNS instance name is at most {MAX_LABEL_BYTES}"
    m = _CONTROL.search(name)
    if m:
        return f"contains the control character {ascii(m.group())}"
    return None


def unadvertisable_problem(name: str) -> str | None:
    """Why python-zeroconf cannot put `name` on the wire as one label, or None. It writes every
    dot as a label break (ZlZeroconf joins them again): a leading, trailing or doubled dot is an
    empty label, which ends a DNS name mid-way (a malformed packet nobody parses), and a last
    part `_sub` reads as a DNS-SD subtype."""
    if name.startswith(".") or name.endswith(".") or ".." in name:
        return "starts or ends with '.' or holds '..'"
    if name.rpartition(".")[2].lower() == "_sub" and "." in name:
        return "ends in '._sub', which DNS-SD reads as a subtype"
    return None


def check_instance_name(name: str) -> str:
    problem = instance_name_problem(name)
    if problem:
        raise InstanceNameError(f"device name {name!r} {problem}: use a shorter name without control characters")
    problem = unadvertisable_problem(name)
    if problem:  # PROTOCOL.md 10.2 allows it; this device's mDNS stack cannot carry it
        raise InstanceNameError(f"device name {name!r} {problem}, which this phone's mDNS stack cannot advertise "
                                "as one label: use dots only between other characters (e.g. 'Dr. Who')")
    return name


def escape_instance(label: str) -> str:
    """RFC 6763 4.3 presentation form of an instance label: '.' -> '\\.', '\\' -> '\\\\'."""
    return label.replace("\\", "\\\\").replace(".", "\\.")


def unescape_instance(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            out.append(text[i + 1])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def instance_of(full_name: str) -> str:
    """The instance label of `<Instance>._zerolock._tcp.local.` (dots in the instance kept)."""
    if full_name.lower().endswith("." + SERVICE_TYPE.lower()):
        return full_name[: -len(SERVICE_TYPE) - 1]
    return full_name.split(".")[0]


def renamed(base: str, n: int) -> str:
    """The n-th name to try when `base` is taken: "base (n)", cut to fit one label."""
    suffix = f" ({n})"
    room = MAX_LABEL_BYTES - len(suffix.encode())
    cut = base.encode("utf-8")[:room].decode("utf-8", "ignore")
    return cut + suffix


def host_label(name: str, salt: str) -> str:
    """An RFC 952-style host label for the SRV target: letters, digits, '-', unique per phone."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().lower()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_name).strip("-")[:40].strip("-") or "zl-phone"
    return f"{slug}-{hashlib.sha256(f'{name}|{salt}'.encode()).hexdigest()[:8]}"


# ---------------------------------------------------------------- TXT records
def txt_record(name: str, proto: int, runtime: str, memory_bytes: int, **optional) -> dict[str, str]:
    """What a phone advertises (docs/PROTOCOL.md 10.3); optional keys (cpu_share) when given."""
    txt = {"name": name, "proto": str(proto), "runtime": runtime, "mem": str(memory_bytes)}
    for k, v in optional.items():
        if v is not None:
            txt[k] = (f"{v:.9f}".rstrip("0").rstrip(".") or "0") if isinstance(v, float) else str(v)  # never 1e-05
    return txt


def parse_txt(props: dict) -> dict[str, str]:
    """TXT properties as text (zeroconf gives bytes): for display; check_txt validates."""
    out = {}
    for k, v in props.items():
        k = k.decode("utf-8", "replace") if isinstance(k, bytes) else k
        v = v.decode("utf-8", "replace") if isinstance(v, bytes) else (v or "")
        out[k] = v
    return out


@dataclass
class TxtCheck:
    """A TXT record checked against docs/PROTOCOL.md 10.3."""
    status: str                     # "ok", "invalid" (a required key missing or bad), "incompatible" (proto)
    name: str | None = None
    proto: int | None = None
    runtime: str | None = None
    memory_bytes: int | None = None
    cpu_share: float | None = None
    problems: dict[str, str] = field(default_factory=dict)  # key -> what is wrong with it

    @property
    def reason(self) -> str:
        return "; ".join(f"{k} {v}" for k, v in self.problems.items())


def _text(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8")  # UnicodeDecodeError: the caller reports it
    return str(v)


def check_txt(props: dict) -> TxtCheck:
    """Check a TXT record: a dict of key -> value (str or bytes; None for a key without '=').

    Keys compare case-insensitively, unknown keys are ignored. Never raises."""
    attrs: dict[str, object] = {}
    for k, v in props.items():
        key = (k.decode("ascii", "replace") if isinstance(k, (bytes, bytearray)) else str(k)).lower()
        attrs.setdefault(key, v)
    problems: dict[str, str] = {}

    def value(key: str) -> str | None:
        if key not in attrs:
            if key in REQUIRED_KEYS:
                problems[key] = "is missing"
            return None
        raw = attrs[key]
        if raw is None:
            problems[key] = "has no value (write key=value)"
            return None
        try:
            v = _text(raw)
        except UnicodeDecodeError:
            problems[key] = "is not UTF-8"
            return None
        if _CONTROL.search(v):
            problems[key] = f"{v!r} contains a control character"
            return None
        return v

    out = TxtCheck("invalid")
    p = value("proto")
    if p is not None:
        if _DIGITS.fullmatch(p) and len(p) <= 9:
            out.proto = int(p)
        else:
            problems["proto"] = f"{p!r} is not a protocol version (a whole number)"
    name = value("name")
    if name is not None:
        np_ = instance_name_problem(name)
        if np_:
            problems["name"] = f"{name!r} {np_}"
        else:
            out.name = name
    if out.proto is not None and out.proto != PROTO:
        out.status = "incompatible"
        out.problems = {"proto": f"{out.proto} is not this host's protocol version {PROTO}"}
        return out
    rt = value("runtime")
    if rt is not None:
        if not rt or len(rt.encode()) > 200:
            problems["runtime"] = f"{rt!r} must be 1-200 bytes"
        else:
            out.runtime = rt
    mem = value("mem")
    if mem is not None:
        if _DIGITS.fullmatch(mem) and int(mem) < 2**63:
            out.memory_bytes = int(mem)
        else:
            problems["mem"] = f"{mem!r} is not a whole number of bytes"
    share = value("cpu_share") if "cpu_share" in attrs else None
    if share is not None:
        x = float(share) if _DECIMAL.fullmatch(share) else math.nan
        if 0 < x <= CPU_SHARE_MAX:
            out.cpu_share = x
        else:
            problems["cpu_share"] = f"{share!r} is not a decimal number of cores in (0, {CPU_SHARE_MAX:g}]"
    out.problems = problems
    out.status = "ok" if not problems else "invalid"
    return out


# ---------------------------------------------------------------- one label on the wire
_T_CNAME, _T_PTR, _T_SRV, _T_NSEC = 5, 12, 33, 47
_OUR_TYPE = tuple(SERVICE_TYPE.rstrip(".").encode().split(b"."))


class _Bad(Exception):
    pass


def _read_name(buf: bytes, off: int) -> tuple[list[bytes], int]:
    labels, end, jumps = [], None, 0
    while True:
        if off >= len(buf):
            raise _Bad
        n = buf[off]
        if n == 0:
            return labels, (end if end is not None else off + 1)
        if n >= 0xC0:
            if off + 1 >= len(buf) or jumps > 64:
                raise _Bad
            if end is None:
                end = off + 2
            off = (n & 0x3F) << 8 | buf[off + 1]
            jumps += 1
            continue
        if n >= 0x40:
            raise _Bad
        labels.append(buf[off + 1: off + 1 + n])
        off += 1 + n


def _one_label(labels: list[bytes]) -> list[bytes]:
    """[b'Dr', b" Who's phone", b'_zerolock', b'_tcp', b'local'] -> [b"Dr. Who's phone", ...]."""
    k = len(_OUR_TYPE)
    if len(labels) > k + 1 and tuple(x.lower() for x in labels[-k:]) == _OUR_TYPE and labels[-k - 1] != b"_sub":
        return [b".".join(labels[:-k]), *labels[-k:]]
    return labels


class _Writer:
    def __init__(self):
        self.out = bytearray()
        self.seen: dict[tuple, int] = {}

    def name(self, labels: list[bytes]) -> None:
        for i in range(len(labels)):
            key = tuple(x.lower() for x in labels[i:])
            if key in self.seen:
                self.out += bytes([0xC0 | self.seen[key] >> 8, self.seen[key] & 0xFF])
                return
            if len(self.out) < 0x3FFF:
                self.seen[key] = len(self.out)
            if len(labels[i]) > MAX_LABEL_BYTES:
                raise _Bad
            self.out += bytes([len(labels[i])]) + labels[i]
        self.out.append(0)


def one_label_instances(packet: bytes) -> bytes:
    """The same DNS message with every `<Instance>._zerolock._tcp.local` name's instance as one
    label (python-zeroconf writes a dotted instance as several labels). Unchanged when nothing
    needs it, or when the packet does not parse."""
    try:
        if len(packet) < 12:
            return packet
        counts = [int.from_bytes(packet[4 + 2 * i: 6 + 2 * i], "big") for i in range(4)]
        w, off, changed = _Writer(), 12, False
        w.out += packet[:12]

        def name_at(o):
            nonlocal changed
            labels, o = _read_name(packet, o)
            fixed = _one_label(labels)
            changed |= fixed is not labels
            w.name(fixed)
            return o

        for _ in range(counts[0]):
            off = name_at(off)
            w.out += packet[off: off + 4]
            off += 4
        for _ in range(sum(counts[1:])):
            off = name_at(off)
            rtype = int.from_bytes(packet[off: off + 2], "big")
            w.out += packet[off: off + 8]
            rdlen = int.from_bytes(packet[off + 8: off + 10], "big")
            off += 10
            start, end = off, off + rdlen
            if end > len(packet):
                return packet
            len_at = len(w.out)
            w.out += b"\0\0"
            if rtype in (_T_PTR, _T_CNAME):
                name_at(start)
            elif rtype == _T_SRV:
                w.out += packet[start: start + 6]
                name_at(start + 6)
            elif rtype == _T_NSEC:
                after = name_at(start)
                w.out += packet[after: end]
            else:
                w.out += packet[start: end]
            w.out[len_at: len_at + 2] = (len(w.out) - len_at - 2).to_bytes(2, "big")
            off = end
        if off != len(packet):  # records past the end, or bytes after them: not a message we wrote
            return packet
        return bytes(w.out) if changed else packet
    except (_Bad, IndexError, ValueError):
        return packet


class _Relabelled:
    """A DNSOutgoing whose packets carry one-label instance names."""

    def __init__(self, out):
        self._out = out

    def packets(self):
        return [one_label_instances(p) for p in self._out.packets()]

    def __getattr__(self, k):
        return getattr(self._out, k)

    def __repr__(self):
        return repr(self._out)


def _zeroconf(interfaces):
    from zeroconf import InterfaceChoice, IPVersion, Zeroconf

    class ZlZeroconf(Zeroconf):
        """Zeroconf whose outgoing packets keep a dotted instance name as one DNS label."""

        def async_send(self, out, *args, **kwargs):
            return super().async_send(_Relabelled(out), *args, **kwargs)

    if interfaces in (None, "all"):
        return ZlZeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
    return ZlZeroconf(interfaces=list(interfaces), ip_version=IPVersion.V4Only)


# ---------------------------------------------------------------- addresses
def lan_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (ifaddr, which zeroconf uses too)."""
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and not ip.ip.startswith("127.") and not ip.ip.startswith("169.254.") and ip.ip not in out:
                out.append(ip.ip)
    return out


def advertised_addresses(bind: str, mdns: str) -> list[str]:
    """What a phone listening on `bind` advertises on `mdns` (loopback, all, or an IPv4 address):
    the address it is bound to; bound to 0.0.0.0, the addresses peers on those interfaces reach."""
    if bind not in ("0.0.0.0", ""):
        return [bind]
    if mdns == "loopback":
        return ["127.0.0.1"]
    if mdns == "all":
        return lan_addresses() or ["127.0.0.1"]
    return [mdns]


# ---------------------------------------------------------------- advertising
class Advertisement:
    """One `_zerolock._tcp` service, registered under a name no other responder holds.

    Before it claims a name it asks for it (see PROBE_MS) and zeroconf probes it (RFC 6762 8.1);
    a taken name becomes "NAME (2)", "NAME (3)", ... Afterwards (RFC 6762 9) it watches for another
    responder announcing an SRV record for its name with other data (two devices that probed at the
    same moment): of the two, the one whose SRV data (port, host) sorts lower renames itself, so
    exactly one moves. `on_rename(label)` is called then (from a background thread)."""

    def __init__(self, name: str, port: int, txt: dict[str, str], address: str | None = None,
                 interfaces=LOOPBACK, addresses: list[str] | None = None, probe_ms: int = PROBE_MS,
                 on_rename=None, probe: bool = True):
        check_instance_name(name)
        self.requested = name
        self.port = port
        self.txt = txt
        self.addresses = addresses or [address or "127.0.0.1"]
        self.probe_ms = probe_ms
        self.probe = probe  # False: claim without asking first (only tests of the conflict handling want that)
        self.on_rename = on_rename
        self.lock = threading.Lock()
        self.closed = False
        self.renaming = False
        self.attempt = 0
        self.zc = _zeroconf(interfaces)
        self.info = self.claiming = None
        try:
            # watching starts before the claim: two devices that claim one name in the same instant
            # announce while each is still registering, and those announcements are the only ones
            self._watch()
            with self.lock:  # a rename this triggers waits until the claim is done
                self.info = self._claim()
        except BaseException:
            self.zc.close()
            raise

    def _claim(self):
        from zeroconf import DNSQuestionType, NonUniqueNameException, ServiceInfo

        while self.attempt < MAX_RENAMES:
            self.attempt += 1
            candidate = self.requested if self.attempt == 1 else renamed(self.requested, self.attempt)
            full = f"{candidate}.{SERVICE_TYPE}"
            # another responder already answering for it? (a multicast question: each zeroconf
            # on this machine hears it and answers by multicast; see PROBE_MS)
            if self.probe and self.zc.get_service_info(SERVICE_TYPE, full, timeout=self.probe_ms,
                                                       question_type=DNSQuestionType.QM):
                continue
            salt = f"{socket.gethostname()}|{self.addresses}|{self.port}"
            info = ServiceInfo(SERVICE_TYPE, full, addresses=[socket.inet_aton(a) for a in self.addresses],
                               port=self.port, properties=self.txt, server=f"{host_label(candidate, salt)}.local.")
            try:
                self.claiming = info
                self.zc.register_service(info, allow_name_change=False, cooperating_responders=not self.probe)
            except NonUniqueNameException:
                continue
            return info
        raise AdvertiseError(f"could not advertise {self.requested!r}: it and {MAX_RENAMES - 1} renamed variants are "
                             "taken on this network; start the phone with another --name")

    def _watch(self) -> None:
        from zeroconf import RecordUpdateListener

        ad = self

        class Guard(RecordUpdateListener):
            def async_update_records(self, zc, now, records):
                for update in records:
                    rec = update.new
                    if rec.type == _T_SRV and rec.ttl > 0 and ad._conflicts(rec):
                        ad._lost_name(rec.name)
                        return

        self.zc.add_listener(Guard(), None)

    def _conflicts(self, rec) -> bool:
        info = self.info or self.claiming
        if info is None or self.renaming or rec.name.lower() != info.name.lower():
            return False
        theirs, ours = (rec.port, rec.server.lower()), (info.port, info.server.lower())
        return theirs != ours and ours < theirs  # the lower one gives way (RFC 6762 8.2 / 9)

    def _lost_name(self, name: str) -> None:
        self.renaming = True
        threading.Thread(target=self._rename, args=(name,), name="mdns-rename", daemon=True).start()

    def _rename(self, name: str) -> None:
        with self.lock:
            if self.closed or self.info is None or self.info.name.lower() != name.lower():
                self.renaming = False  # the claim in progress moved to another name already
                return
            old = self.info
            try:
                self.zc.unregister_service(old)
                self.info = self._claim()
            except Exception as e:  # noqa: BLE001 - a phone keeps serving; the host can still use ADDRESS:PORT
                import logging
                logging.getLogger(__name__).warning("mDNS: lost the name %r to another device and could not "
                                                    "take another (%s)", instance_of(old.name), e)
                return
            finally:
                self.renaming = False
        if self.on_rename is not None:
            self.on_rename(self.instance_label)

    @property
    def instance(self) -> str:
        return self.info.name

    @property
    def instance_label(self) -> str:
        return instance_of(self.info.name)

    @property
    def presentation(self) -> str:
        """The full service name as RFC 6763 4.3 writes it (dots in the instance escaped)."""
        return f"{escape_instance(self.instance_label)}.{SERVICE_TYPE}"

    @property
    def renamed(self) -> bool:
        return self.instance_label != self.requested

    def close(self) -> None:
        """Withdraw the service (goodbye packets with TTL 0, RFC 6762 10.1), then stop."""
        with self.lock:
            self.closed = True
            try:
                self.zc.unregister_service(self.info)
            finally:
                self.zc.close()


# ---------------------------------------------------------------- browsing
@dataclass
class Found:
    name: str
    address: str
    port: int
    proto: int | None
    runtime: str
    memory_bytes: int
    source: str = "mdns"
    instance: str = ""
    addresses: list[str] = field(default_factory=list)
    status: str = "ok"               # ok | invalid | incompatible (docs/PROTOCOL.md 10.3)
    problem: str = ""
    cpu_share: float | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


def found_from(full_name: str, port: int, addresses: list[str], props: dict) -> Found:
    """A browsed service as the host lists it: never raises, whatever the TXT record holds."""
    inst = instance_of(full_name)
    chk = check_txt(props)
    problem = chk.reason
    status = chk.status
    if not addresses:
        status, problem = "invalid", "; ".join(x for x in (problem, "no IPv4 address") if x)
    return Found(name=chk.name or inst, address=addresses[0] if addresses else "", port=port, proto=chk.proto,
                 runtime=chk.runtime or "?", memory_bytes=chk.memory_bytes or 0, instance=inst,
                 addresses=list(addresses), status=status, problem=problem, cpu_share=chk.cpu_share)


def invalid_instance(full_name: str, why: str) -> Found:
    """A service listed but never used: its name and instance shown quoted (PROTOCOL.md 7), as the
    raw label may hold ESC or BEL that would drive the terminal of whoever lists devices."""
    shown = quote(instance_of(full_name))
    return Found(name=shown, address="", port=0, proto=None, runtime="?", memory_bytes=0, instance=shown,
                 status="invalid", problem=why)


def unresolvable(full_name: str) -> Found | None:
    """An advert whose instance label 10.2 forbids (python-zeroconf refuses to even look it up):
    listed as invalid with the reason; None when the label is fine."""
    problem = instance_name_problem(instance_of(full_name))
    if problem is None:
        return None
    return invalid_instance(full_name, f"instance name {problem}: rename the phone (docs/PROTOCOL.md 10.2)")


def browse(timeout: float = 2.0, interfaces=LOOPBACK, until=None, settle_s: float = 0.5) -> list[Found]:
    """Services answering on the given interfaces within `timeout` s (or once `until(found)` is
    true of the valid ones, and no new service has turned up for `settle_s`: responders answer a
    browse within ~120 ms of each other, so a namesake is not missed by stopping at the first):
    every one, valid or not (Found.status says which)."""
    from zeroconf import ServiceBrowser

    zc = _zeroconf(interfaces)
    names: list[str] = []
    last_new = [time.time()]
    lock = threading.Lock()

    class Listener:
        def add_service(self, zc_, type_, name):
            with lock:
                names.append(name)
                last_new[0] = time.time()

        def update_service(self, *a):
            pass

        def remove_service(self, *a):
            pass

    browser = ServiceBrowser(zc, SERVICE_TYPE, Listener())
    found: dict[str, Found] = {}
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            with lock:
                pending = [n for n in names if n not in found]
            for n in pending:
                bad = unresolvable(n)  # one bad advert is listed with its reason; it never stops the browse
                if bad is not None:
                    found[n] = bad
                    continue
                try:
                    info = zc.get_service_info(SERVICE_TYPE, n, timeout=1000)
                except Exception as e:  # noqa: BLE001 - whatever zeroconf makes of a stranger's advert
                    found[n] = invalid_instance(n, f"could not be resolved ({type(e).__name__}: {quote(str(e))})")
                    continue
                if info is None:
                    continue
                found[n] = found_from(n, info.port or 0, info.parsed_addresses(), info.properties or {})
            with lock:
                settled = time.time() - last_new[0] >= settle_s and all(n in found for n in names)
            if until is not None and settled and until([f for f in found.values() if f.status == "ok"]):
                break
            time.sleep(0.1)
    finally:
        browser.cancel()
        zc.close()
    return sorted(found.values(), key=lambda f: (f.name, f.instance, f.endpoint))
