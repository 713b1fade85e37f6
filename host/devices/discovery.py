"""Finding phones: mDNS (phones and emulated phones) and adb (phones on USB), and their tokens."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from zl_mobile.mdns import LOOPBACK, browse

from ..run.coordinator import DeviceHandle
from .adb_wiring import APP_PORT  # noqa: F401  the app's control port (adb-forwarded for USB phones)

PHONES_HOME = Path.home() / ".zerolock" / "phones"


class DeviceLookupError(Exception):
    pass


@dataclass
class Reachable:
    name: str
    source: str          # "mdns" or "adb"
    endpoint: str | None
    protocol: int | None
    runtime: str
    memory_bytes: int
    serial: str | None = None
    model: str = ""      # adb: the phone's model, when adb reports it
    state: str = ""      # adb: "device" (ready), "unauthorized", "offline", ...
    instance: str = ""   # mdns: the DNS-SD instance label (differs from name after a conflict rename)
    status: str = "ok"   # mdns: ok | invalid | incompatible (its TXT record, docs/PROTOCOL.md 10.3)
    problem: str = ""    # mdns: what is wrong with it, when status is not ok

    @property
    def ready(self) -> bool:
        return self.status == "ok" and (self.source != "adb" or self.state == "device")

    @property
    def label(self) -> str:
        """How to name this one device on --devices when its name is shared."""
        return self.serial if self.source == "adb" else (self.endpoint or self.name)


def mdns_interfaces(spec: str):
    return {"loopback": LOOPBACK, "all": "all"}.get(spec, [spec])


def find_devices(timeout: float = 2.0, interfaces: str = "loopback",
                 want: int | None = None) -> tuple[list[Reachable], list[str]]:
    """Everything reachable, plus notes on where we looked (for a plain 'nothing found')."""
    notes = []
    until = (lambda found: len(found) >= want) if want else None
    found = [Reachable(f.name, "mdns", f.endpoint if f.address else None, f.proto, f.runtime, f.memory_bytes,
                       instance=f.instance, status=f.status, problem=f.problem)
             for f in browse(timeout=timeout, interfaces=mdns_interfaces(interfaces), until=until)]
    notes.append(f"mDNS _zerolock._tcp on {interfaces}: {len(found)} found in {timeout:.0f} s")
    for r in found:
        if r.status != "ok":
            notes.append(f"skipped {r.instance!r} at {r.endpoint or '?'}: {r.status} TXT record ({r.problem})")
    names = [name_key(r.name) for r in found if r.status == "ok"]
    for n in sorted({n for n in names if names.count(n) > 1}):
        alike = ", ".join(r.endpoint for r in found if name_key(r.name) == n and r.status == "ok")
        notes.append(f"{names.count(n)} devices named {n!r} ({alike}): name one by ADDRESS:PORT on --devices")
    from .adb import adb_status

    st = adb_status()
    if st.kind == "ok":
        for p in st.phones:  # named by serial: unique, unlike models; tokens are keyed by it
            found.append(Reachable(p.serial, "adb", None, None, "android", 0, serial=p.serial, model=p.model,
                                   state=p.state))
        notes.append(f"adb: {len(st.phones)} device(s)")
    else:
        notes.append(f"adb: {st.message}")
    return found, notes


def load_tokens(path: Path | None) -> dict[str, str]:
    tokens = {}
    if PHONES_HOME.is_dir():  # emulated phones on this machine keep their token in their work dir
        for d in PHONES_HOME.iterdir():
            if (d / "pairing_token").is_file():
                tokens[d.name] = (d / "pairing_token").read_text().strip()
    if path:
        try:
            tokens.update(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise DeviceLookupError(f"cannot read tokens file {path} ({e}): give a JSON object NAME -> pairing token") from None
    return tokens


def resolve(spec: str, need: int, tokens: dict[str, str], wait_s: float, interfaces: str,
            links=None, min_bytes: int = 0) -> list[DeviceHandle]:
    """--devices auto | NAME,NAME,...: wait (bounded) for enough phones, with known tokens.

    Phones on mDNS are used at their endpoint; phones on adb (named by serial) through ``links``
    (host.devices.adb_wiring.AdbLinks), which forwards their control port; without it they are skipped.
    `min_bytes`: auto leaves out phones advertising less memory (the smallest chunk's need)."""
    names = None if spec == "auto" else [n.strip() for n in spec.split(",") if n.strip()]
    deadline = time.time() + wait_s

    def reachable(r: Reachable) -> bool:
        return r.ready and (r.endpoint is not None or (r.source == "adb" and links is not None))

    warned: set[str] = set()
    ever: dict[tuple, Reachable] = {}
    alike: set[str] = set()  # auto: names two usable devices share (never guessed between)
    looks = 0
    while True:
        looks += 1
        seen, notes = find_devices(timeout=min(2.0, max(0.5, deadline - time.time())), interfaces=interfaces,
                                   want=None)  # a whole look, not the first answers: see every namesake
        for note in notes:
            if note.startswith("skipped ") and note not in warned:
                warned.add(note)
                print(f"zl-host: warning: {note}", file=sys.stderr)
        usable = [r for r in seen if reachable(r)]
        for r in seen:  # what any look found, for the message if none is enough (one look may miss some)
            ever[(r.source, r.endpoint, r.serial, r.instance)] = r
        # choices are made over every look so far, and not before a second one: one look, on a loaded
        # network, may hear only one of two namesakes, and a name is never guessed between them
        pool = [r for r in ever.values() if reachable(r)]
        if names is not None:
            picked = [pick(n, pool) for n in names]
            unknown = [n for n, r in zip(names, picked) if r is None]
            if not unknown and looks >= 2:
                chosen = picked
                break
        else:
            shared = {r.name for r in pool if sum(name_key(o.name) == name_key(r.name) for o in pool) > 1}
            alike |= shared
            chosen = [r for r in usable if r.name in tokens and r.name not in shared
                      and not (min_bytes and r.memory_bytes and r.memory_bytes < min_bytes)][:need]
            if len(chosen) >= need and looks >= 2:  # a second look before choosing: no namesake missed
                break
        if time.time() >= deadline:
            seen = list(ever.values())
            seen_names = ", ".join(sorted(f"{r.name} ({r.state or r.status})" if not r.ready else r.name for r in seen)) or "none"
            if names is not None:
                bad = [r for r in seen if unknown and (r.name in unknown or r.instance in unknown) and r.status != "ok"]
                if bad:
                    raise DeviceLookupError("; ".join(f"{r.name} at {r.endpoint or '?'} advertises an {r.status} TXT record "
                                                      f"({r.problem})" for r in bad)
                                            + ": update the phone's app (docs/PROTOCOL.md 10.3 lists the keys)")
                waiting = [r for r in seen if r.name in unknown and not r.ready]
                if any(r.state == "unauthorized" for r in waiting):
                    raise DeviceLookupError(f"{', '.join(r.name for r in waiting)} not ready on adb "
                                            f"({', '.join(r.state for r in waiting)}): accept the USB debugging "
                                            "prompt on the phone, then run again")
                raise DeviceLookupError(f"unknown device(s) {', '.join(unknown)} after {wait_s:.0f} s (seen: {seen_names}); "
                                        "check the names with zl-host devices")
            from .problems import problems  # each phone seen but not usable, and why: never a bare count
            why = problems(seen, tokens, alike, PHONES_HOME, min_bytes)
            looked = "; ".join(n for n in notes if not n.startswith("mDNS"))  # the last look's count is not all seen
            chosen = [r for r in chosen if all(r is not bad for bad, _ in why)]  # a busy one is not usable
            raise DeviceLookupError(f"found {len(chosen)} usable device(s) of {need} needed within {wait_s:.0f} s "
                                    f"({len(seen)} seen over mDNS on {interfaces} and adb; {looked})"
                                    + "".join(f"\n  {line}" for _, line in why)
                                    + "\nstart more phones (zl-host emulate N)"
                                    + (" or fix the above" if why else "") + ", then run again")
        time.sleep(0.5)

    def token_of(r: Reachable) -> str | None:
        return next((tokens[k] for k in (r.endpoint, r.serial, r.instance, r.name) if k and k in tokens), None)

    missing_token = [r.name for r in chosen if token_of(r) is None]
    if missing_token:
        raise DeviceLookupError(f"no pairing token for {', '.join(missing_token)}: "
                                "pass --tokens FILE (JSON NAME -> token shown on the phone)")
    dup = {r.name for r in chosen if sum(name_key(o.name) == name_key(r.name) for o in chosen) > 1}
    handles = []
    for r in chosen:
        if r.source == "adb":
            from .adb import AdbCommandError, read_mem_total_bytes
            try:
                endpoint = links.control_endpoint(r.serial)
                memory = read_mem_total_bytes(r.serial, **links.kw)
            except AdbCommandError as e:
                raise DeviceLookupError(str(e)) from None
            handles.append(DeviceHandle(r.name, endpoint, token_of(r), memory, serial=r.serial))
        else:
            name = f"{r.name}@{r.endpoint}" if r.name in dup else r.name
            handles.append(DeviceHandle(name, r.endpoint, token_of(r), r.memory_bytes))
    return handles


def name_key(name: str | None) -> str | None:
    """Device and instance names compare case-insensitively, in ASCII as DNS does (PROTOCOL.md
    10.2): `Alpha` and `alpha` are one name, `Ä` and `ä` two."""
    return None if name is None else "".join(c.lower() if c.isascii() else c for c in name)


def pick(spec: str, usable: list[Reachable]) -> Reachable | None:
    """The one device `spec` names: an ADDRESS:PORT, an adb serial, an mDNS instance, or a name.
    None if none; DeviceLookupError if the name is shared (it says how to name each)."""
    for key in (lambda r: r.endpoint, lambda r: r.serial):
        hits = [r for r in usable if key(r) == spec]
        if len(hits) == 1:
            return hits[0]
    hits = [r for r in usable if name_key(r.name) == name_key(spec)]
    if len(hits) > 1:
        alike = ", ".join(f"{r.label} ({r.source}{', instance ' + repr(r.instance) if r.instance else ''})" for r in hits)
        raise DeviceLookupError(f"--devices {spec}: {len(hits)} devices are named {spec!r} ({alike}): name the one you "
                                "mean by ADDRESS:PORT (mDNS) or serial (adb), e.g. --devices "
                                f"{hits[0].label}; tokens for them may be keyed the same way in --tokens")
    if hits:
        return hits[0]
    hits = [r for r in usable if r.instance and name_key(r.instance) == name_key(spec)]
    return hits[0] if len(hits) == 1 else None


def as_json(found: list[Reachable]) -> str:
    return json.dumps([asdict(f) for f in found], indent=2)
