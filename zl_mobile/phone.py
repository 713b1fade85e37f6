"""zl-phone: turn this process into an emulated phone that serves one ZeroLock host.

It advertises itself over mDNS, keeps what it is sent in its work dir, prints its pairing
token, and runs its chunk on ExecuTorch's runtime (or, with --backend eager, in eager PyTorch on
CPU threads or a CUDA device: see zl_mobile/backends.py). Thread caps, CPU pinning and an outgoing
rate limit make several emulated phones on one machine behave like separate devices."""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
from pathlib import Path


def load_or_create_token(workdir: Path, given: str | None) -> str:
    """The pairing token: `given`, else the one kept in the work dir, else a new one (kept, mode
    0600). ValueError (one line) if `given` or the kept one is not 64 hex digits."""
    from .protocol import parse_token

    path = workdir / "pairing_token"
    if given is not None:
        parse_token(given)  # validates: 64 hex digits
        token = given
    elif path.exists():
        token = path.read_text().strip()
        try:
            parse_token(token)
        except ValueError as e:
            raise ValueError(f"{path}: {e}; delete it to generate a new token, then pair the host again") from None
        return token
    else:
        token = secrets.token_hex(32)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(token)
    return token


_terminated = False


def _terminate(signum, frame):
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def build_parser():
    p = argparse.ArgumentParser(prog="zl-phone", description=__doc__)
    p.add_argument("--name", required=True, help="device name shown to the host")
    p.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    p.add_argument("--workdir", type=Path, default=None, help="storage (default ~/.zerolock/phones/NAME)")
    p.add_argument("--token", default=None, help="pairing token (64 hex digits); default: generated once and kept")
    p.add_argument("--threads", type=int, default=None, help="cap compute threads")
    p.add_argument("--cpus", default=None, help="pin to these CPU cores, e.g. 0 or 0,1")
    p.add_argument("--cpu-share", type=float, default=None,
                   help="limit this phone to this share of one CPU core (e.g. 0.5), in a cgroup of its own that goes "
                        "when the phone does (needs root and the cgroup cpu controller; zl_mobile/cpu_budget.py); "
                        "it computes on ceil(share) threads unless --threads says otherwise")
    p.add_argument("--rate-mbit", type=float, default=None, help="shape outgoing links to this many Mbit/s")
    p.add_argument("--link-delay-ms", type=float, default=0.0,
                   help="see each frame arriving on a stage link (hidden state, gradient, credit) this much later "
                        "(one-way link latency)")
    p.add_argument("--mdns", default="loopback", help="advertise on: loopback (default), all, none, or an IPv4 address")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (0.0.0.0 for a LAN)")
    p.add_argument("--backend", choices=["executorch", "eager"], default="executorch",
                   help="run the chunk's exported program in ExecuTorch (default), or the same chunk in eager "
                        "PyTorch (needs an export made with zl-export --eager-weights; no ExecuTorch needed)")
    p.add_argument("--torch-device", default=None,
                   help="with --backend eager: cpu (default), cuda or cuda:N")
    p.add_argument("--mem-limit", default=None,
                   help="memory this phone may use, e.g. 600M or 1.5G: reported as its budget (HELLO "
                        "memory_budget_bytes) and enforced (the process ends, exit 137, when its resident memory "
                        "passes it, as a phone's low-memory killer would)")
    p.add_argument("--handshake-timeout", type=float, default=10.0,
                   help="seconds a connection has to authenticate (PROTOCOL.md 6); then it is closed")
    p.add_argument("--io-timeout", type=float, default=10.0,
                   help="seconds without a byte inside a frame before the session is dropped (TIMEOUT)")
    p.add_argument("--max-connections", type=int, default=64, help="connections open at once; more are closed")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C ends the phone cleanly even when a shell started it with SIGINT ignored (a
        # background job of a script), which Python would otherwise keep; SIGTERM (how zl-host
        # emulate stops a phone) ends it as cleanly as Ctrl-C: the finally below withdraws the mDNS
        # advertisement (goodbye packets) instead of leaving it cached
        previous = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, signal.default_int_handler),
                                                         (signal.SIGTERM, _terminate))}
    try:
        return _run(a, parser)
    finally:  # a caller in the same process (a test, an app embedding the phone) gets its own back
        for s, h in previous.items():
            signal.signal(s, h)


def _run(a, parser) -> int:
    from .mdns import InstanceNameError, check_instance_name

    try:
        check_instance_name(a.name)  # one mDNS label (docs/PROTOCOL.md 10.2), before anything is written
    except InstanceNameError as e:
        print(f"zl-phone: error: --name: {e}", file=sys.stderr)
        return 2
    if a.link_delay_ms < 0:
        parser.error(f"--link-delay-ms must be >= 0, got {a.link_delay_ms:g}")
    if not (a.handshake_timeout > 0 and a.io_timeout > 0 and a.max_connections >= 1):
        parser.error("--handshake-timeout and --io-timeout must be > 0 and --max-connections >= 1")
    budget = None
    if a.cpu_share is not None:  # first: the imports and loading below run on the budget too
        from .cpu_budget import CpuBudget, CpuBudgetError

        try:
            budget = CpuBudget.enter(a.cpu_share)
        except CpuBudgetError as e:
            print(f"zl-phone: error: {e}", file=sys.stderr)
            return 2
        try:
            code = _main(a, parser, budget)
        finally:
            budget.close()  # SIGTERM too: it unwinds to here (_terminate)
        if _terminated:  # then end as SIGTERM ends a process, as an unbudgeted phone's parent expects
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        return code
    return _main(a, parser, None)


def _main(a, parser, budget) -> int:
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format=f"%(asctime)s {a.name} %(levelname)s %(message)s", stream=sys.stderr)
    from zl_common.quiet import quiet_libraries

    from .cpu_budget import threads_for_share
    from .heap import fix_mmap_threshold

    fix_mmap_threshold()  # large frame buffers go back to the system when freed (zl_mobile/heap.py)
    quiet_libraries(transformers=False)  # torchao's and torch's messages that are not errors (eager backend)
    if a.cpus:
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})
    threads = a.threads or (len(a.cpus.split(",")) if a.cpus else None) or (
        threads_for_share(a.cpu_share) if a.cpu_share is not None else None)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if a.token is not None:
        from .protocol import parse_token
        try:
            parse_token(a.token)
        except ValueError as e:  # before anything is created or written
            print(f"zl-phone: error: --token: {e}", file=sys.stderr)
            return 2
    limit = None
    if a.mem_limit is not None:
        from .memlimit import MemoryLimit, parse_size
        try:
            limit = MemoryLimit(parse_size(a.mem_limit), a.name)
        except ValueError as e:
            print(f"zl-phone: error: --mem-limit: {e}", file=sys.stderr)
            return 2
    # the backend's options (for eager, its torch device): after the affinity/thread settings, before
    # anything is written
    from .backends import Backend, BackendError

    try:
        backend = Backend.from_args(a.backend, a.torch_device)
    except BackendError as e:
        print(f"zl-phone: error: {e}", file=sys.stderr)
        return 2
    workdir = a.workdir or Path.home() / ".zerolock" / "phones" / a.name
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        token = load_or_create_token(workdir, a.token)
        backend.check_runtime()  # imports ExecuTorch (and torch) for the default backend
    except ValueError as e:  # BackendError too
        print(f"zl-phone: error: {e}", file=sys.stderr)
        return 2
    if threads:
        backend.set_threads(threads)

    from .device import Device, Limits, serve
    from .links import DelayLine
    from .mdns import PROTO, SERVICE_TYPE, Advertisement, advertised_addresses, escape_instance, txt_record
    from .protocol import RateLimiter
    from .telemetry import total_memory_bytes

    limiter = RateLimiter(a.rate_mbit * 1e6 / 8) if a.rate_mbit else None
    delay = DelayLine(a.link_delay_ms / 1000) if a.link_delay_ms > 0 else None
    limits = Limits(handshake_s=a.handshake_timeout, io_s=a.io_timeout, max_connections=a.max_connections)
    device = Device(a.name, workdir, token, limiter=limiter, bind=a.bind, backend=backend, link_delay=delay,
                    cpu_share=budget.share if budget else None, memory_limit=limit.start() if limit else None,
                    limits=limits)
    adverts = []

    def ready(port: int) -> None:
        print(f"zl-phone {a.name}: listening on {a.bind}:{port}, work dir {workdir}, backend {backend.label}"
              + (f", CPU budget {budget.share:g} of a core ({budget.path})" if budget else "")
              + (f", {threads} compute thread{'s' if threads > 1 else ''}" if threads else ""), flush=True)
        print(f"pairing token: {token}", flush=True)
        if a.mdns != "none":
            interfaces = {"loopback": ["127.0.0.1"], "all": "all"}.get(a.mdns, [a.mdns])
            addresses = advertised_addresses(a.bind, a.mdns)
            txt = txt_record(a.name, PROTO, f"zl_mobile/{backend.label}", total_memory_bytes(),
                             cpu_share=budget.share if budget else None)
            adverts.append(Advertisement(a.name, port, txt, addresses=addresses, interfaces=interfaces,
                                         on_rename=lambda label: print(f"advertised as {escape_instance(label)}.{SERVICE_TYPE} "
                                                                       f"now: another device claimed {a.name!r} at the same "
                                                                       "moment", flush=True)))
            ad = adverts[-1]
            taken = f" (renamed: another device holds {a.name!r})" if ad.renamed else ""
            print(f"advertised as {ad.presentation} on {a.mdns} at {', '.join(addresses)}{taken}", flush=True)

    try:
        serve(device, a.port, bind=a.bind, ready=ready)
    except KeyboardInterrupt:
        pass
    finally:
        # mDNS goodbyes are best effort: a multicast send or zeroconf's loop stalling must not keep
        # Ctrl-C (or the host's SIGTERM) from ending the phone
        closing = [threading.Thread(target=ad.close, name="mdns-goodbye", daemon=True) for ad in adverts]
        for t in closing:
            t.start()
        for t in closing:
            t.join(timeout=5.0)
        device.stop_stage()
    return 0


if __name__ == "__main__":
    sys.exit(main())
