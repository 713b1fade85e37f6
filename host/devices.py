"""Finding phones: mDNS (phones and emulated phones) and adb (phones on USB), and their tokens."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from zl_mobile.mdns import LOOPBACK, browse

from .adb_wiring import APP_PORT  # noqa: F401  the app's control port (adb-forwarded for USB phones)
from .coordinator import DeviceHandle

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

    @property
    def ready(self) -> bool:
        return self.source != "adb" or self.state == "device"


def mdns_interfaces(spec: str):
    return {"loopback": LOOPBACK, "all": "all"}.get(spec, [spec])


def find_devices(timeout: float = 2.0, interfaces: str = "loopback", want: int | None = None) -> tuple[list[Reachable], list[str]]:
    """Everything reachable, plus notes on where we looked (for a plain 'nothing found')."""
    notes = []
    until = (lambda found: len(found) >= want) if want else None
    found = [Reachable(f.name, "mdns", f.endpoint, f.proto, f.runtime, f.memory_bytes)
             for f in browse(timeout=timeout, interfaces=mdns_interfaces(interfaces), until=until)]
    notes.append(f"mDNS _zerolock._tcp on {interfaces}: {len(found)} found in {timeout:.0f} s")
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
            links=None) -> list[DeviceHandle]:
    """--devices auto | NAME,NAME,...: wait (bounded) for enough phones, with known tokens.

    Phones on mDNS are used at their endpoint; phones on adb (named by serial) through ``links``
    (host.adb_wiring.AdbLinks), which forwards their control port; without it they are skipped."""
    names = None if spec == "auto" else [n.strip() for n in spec.split(",") if n.strip()]
    deadline = time.time() + wait_s

    def reachable(r: Reachable) -> bool:
        return r.ready and (r.endpoint is not None or (r.source == "adb" and links is not None))

    while True:
        seen, notes = find_devices(timeout=min(2.0, max(0.5, deadline - time.time())), interfaces=interfaces, want=need)
        if names is not None:
            by_name = {r.name: r for r in seen if reachable(r)}
            unknown = [n for n in names if n not in by_name]
            if not unknown:
                chosen = [by_name[n] for n in names]
                break
        else:
            chosen = [r for r in seen if reachable(r) and r.name in tokens][:need]
            if len(chosen) >= need:
                break
        if time.time() >= deadline:
            seen_names = ", ".join(sorted(f"{r.name} ({r.state})" if not r.ready else r.name for r in seen)) or "none"
            if names is not None:
                waiting = [r for r in seen if r.name in unknown and not r.ready]
                if any(r.state == "unauthorized" for r in waiting):
                    raise DeviceLookupError(f"{', '.join(r.name for r in waiting)} not ready on adb "
                                            f"({', '.join(r.state for r in waiting)}): accept the USB debugging "
                                            "prompt on the phone, then run again")
                raise DeviceLookupError(f"unknown device(s) {', '.join(unknown)} after {wait_s:.0f} s (seen: {seen_names}); "
                                        "check the names with zl-host devices")
            raise DeviceLookupError(f"found {len(chosen)} usable device(s) of {need} needed within {wait_s:.0f} s "
                                    f"(seen: {seen_names}; {'; '.join(notes)}): start more phones "
                                    "(zl-host emulate N) or pass their tokens with --tokens")
        time.sleep(0.5)
    missing_token = [r.name for r in chosen if r.name not in tokens]
    if missing_token:
        raise DeviceLookupError(f"no pairing token for {', '.join(missing_token)}: pass --tokens FILE (JSON NAME -> token shown on the phone)")
    handles = []
    for r in chosen:
        if r.source == "adb":
            from .adb import AdbCommandError, read_mem_total_bytes
            try:
                endpoint = links.control_endpoint(r.serial)
                memory = read_mem_total_bytes(r.serial, **links.kw)
            except AdbCommandError as e:
                raise DeviceLookupError(str(e)) from None
            handles.append(DeviceHandle(r.name, endpoint, tokens[r.name], memory, serial=r.serial))
        else:
            handles.append(DeviceHandle(r.name, r.endpoint, tokens[r.name], r.memory_bytes))
    return handles


def as_json(found: list[Reachable]) -> str:
    return json.dumps([asdict(f) for f in found], indent=2)
