"""Why phones that `--devices auto` found were not used: one line per phone, naming it, the reason
(no pairing token, busy, wrong protocol, not enough memory, ...) and what to do. host/devices/discovery.py's
resolve raises this instead of a bare count, so a phone that is seen is never reported as missing."""
from __future__ import annotations

from pathlib import Path


def min_chunk_bytes(program: Path, manifest: dict, schedule: str = "zerolock") -> int:
    """The least memory any chunk needs (the frozen weights + saved activations of the program the
    schedule runs, as host.run.settings.assign_by_memory weighs them): a phone advertising less can run none."""
    from zl_common.manifest import Manifest, ManifestError

    try:
        entries = [c.for_schedule(schedule) for c in Manifest.from_json(manifest).chunks]
    except ManifestError:
        return 0  # no floor: the coordinator names what the export lacks
    need = []
    for c in entries:
        try:
            weights = (Path(program) / c.weights).stat().st_size
        except (TypeError, OSError):
            weights = 0
        need.append(weights + (c.saved_activation_bytes or 0))
    return min(need, default=0)


def is_busy(endpoint: str, token: str, timeout: float = 3.0) -> bool:
    """The phone refuses a handshake with BUSY: it serves another host's session now."""
    from zl_mobile.connection import connect
    from zl_mobile.protocol import ErrorCode, ProtocolError, host_handshake

    try:
        sock = connect(endpoint, timeout=timeout)
    except OSError:
        return False
    try:
        sock.settimeout(timeout)
        host_handshake(sock, token, host_name="zl-host")
        return False
    except ProtocolError as e:
        return e.code == ErrorCode.BUSY
    except (OSError, ValueError):
        return False
    finally:
        sock.close()


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def problems(seen: list, tokens: dict[str, str], alike: set[str], phones_home: Path, min_bytes: int = 0,
             probe=is_busy) -> list[tuple[object, str]]:
    """(device, line) for each device in `seen` (host.devices.discovery.Reachable) that auto could not use, the
    line saying why and what to do (device None: the namesakes' one line); none for a usable one.
    `phones_home`: where emulated phones keep their tokens.
    `probe(endpoint, token)` says whether a phone is busy (asked only of phones otherwise usable)."""
    out = []
    for r in sorted(seen, key=lambda r: (r.name, r.endpoint or r.serial or "")):
        why = _why(r, tokens, alike, phones_home, min_bytes, probe)
        if why:
            where = f"{r.name} at {r.endpoint}" if r.endpoint else f"{r.name} ({r.source})"
            out.append((r, f"{where}: {why}"))
    if alike:  # auto never guesses between two devices of one name
        out.append((None, f"left out, named alike: {', '.join(sorted(alike))}: name each with --devices "
                          "ADDRESS:PORT,..."))
    return out


def _why(r, tokens: dict[str, str], alike: set[str], phones_home: Path, min_bytes: int, probe) -> str | None:
    token = next((tokens[k] for k in (r.endpoint, r.serial, r.instance, r.name) if k and k in tokens), None)
    if r.source == "adb" and r.state != "device":
        fix = "accept the USB debugging prompt on the phone" if r.state == "unauthorized" else \
            "reconnect its USB cable until `adb devices` lists it as 'device'"
        return f"adb says {r.state!r}: {fix}"
    if r.status == "incompatible":
        return f"wrong protocol ({r.problem}): update the phone's app or zl-host so both speak the same version"
    if r.status != "ok":
        return f"invalid TXT record ({r.problem}): update the phone's app (docs/PROTOCOL.md 10.3)"
    if r.source == "mdns" and not r.endpoint:
        return "advertised without an IPv4 address: check the phone's network"
    if r.name in alike:
        return None  # one line for all namesakes
    if token is None:
        return (f"no pairing token (none in {Path(phones_home) / r.name / 'pairing_token'} nor --tokens): pass "
                "--tokens FILE (JSON NAME -> the token the phone shows, or prints on start)")
    if min_bytes and r.memory_bytes and r.memory_bytes < min_bytes:
        return (f"not enough memory (advertises {_mib(r.memory_bytes)}; the smallest chunk needs {_mib(min_bytes)}): "
                "use a phone with more memory, or export smaller chunks")
    if r.endpoint and probe(r.endpoint, token):
        return "busy, serving another host's session: wait for that run to end, or stop it"
    return None
