"""mDNS/DNS-SD: phones advertise `_zerolock._tcp.local.`; the host browses for them.

Emulated phones advertise on loopback by default, so nothing leaves the machine; real
phones (and a host looking for them) use the LAN interfaces."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

SERVICE_TYPE = "_zerolock._tcp.local."
LOOPBACK = ["127.0.0.1"]


def _zeroconf(interfaces):
    from zeroconf import InterfaceChoice, IPVersion, Zeroconf

    if interfaces in (None, "all"):
        return Zeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
    return Zeroconf(interfaces=list(interfaces), ip_version=IPVersion.V4Only)


def txt_record(name: str, proto: int, runtime: str, memory_bytes: int, cpu_share: float | None = None) -> dict[str, str]:
    txt = {"name": name, "proto": str(proto), "runtime": runtime, "mem": str(memory_bytes)}
    if cpu_share is not None:  # zl-phone --cpu-share: the share of one core the phone is held to
        txt["cpu_share"] = f"{cpu_share:g}"
    return txt


class Advertisement:
    def __init__(self, name: str, port: int, txt: dict[str, str], address: str = "127.0.0.1", interfaces=LOOPBACK):
        from zeroconf import ServiceInfo

        self.zc = _zeroconf(interfaces)
        self.info = ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", addresses=[socket.inet_aton(address)],
                                port=port, properties=txt, server=f"{name}.local.")
        # another device with the same instance name gets a suffixed instance; TXT keeps our name
        self.zc.register_service(self.info, allow_name_change=True)

    @property
    def instance(self) -> str:
        return self.info.name

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


@dataclass
class Found:
    name: str
    address: str
    port: int
    proto: int | None
    runtime: str
    memory_bytes: int
    source: str = "mdns"

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


def parse_txt(props: dict) -> dict[str, str]:
    out = {}
    for k, v in props.items():
        k = k.decode() if isinstance(k, bytes) else k
        v = v.decode() if isinstance(v, bytes) else (v or "")
        out[k] = v
    return out


def browse(timeout: float = 2.0, interfaces=LOOPBACK, until=None) -> list[Found]:
    """Phones answering on the given interfaces within `timeout` s (or once `until(found)` is true)."""
    from zeroconf import ServiceBrowser

    zc = _zeroconf(interfaces)
    names: list[str] = []
    lock = threading.Lock()

    class Listener:
        def add_service(self, zc_, type_, name):
            with lock:
                names.append(name)

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
                info = zc.get_service_info(SERVICE_TYPE, n, timeout=1000)
                if info is None or not info.parsed_addresses():
                    continue
                txt = parse_txt(info.properties)
                found[n] = Found(name=txt.get("name", n.split(".")[0]), address=info.parsed_addresses()[0],
                                 port=info.port, proto=int(txt["proto"]) if txt.get("proto", "").isdigit() else None,
                                 runtime=txt.get("runtime", "?"), memory_bytes=int(txt.get("mem", "0") or 0))
            if until is not None and until(list(found.values())):
                break
            time.sleep(0.1)
    finally:
        browser.cancel()
        zc.close()
    return sorted(found.values(), key=lambda f: f.name)
