"""Emulated phones, several at once: started on this machine (zl-phone or Kotlin phones), their
links and CPU shares (one phone is host/phones/emulated_phone.py)."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..cli.error import CliError
from .emulated_phone import EmulatedPhone

if TYPE_CHECKING:
    from .netns import ShapedNetwork


@dataclass
class EmulatedLinks:
    """How zl-host's emulated phones are linked (zl-host run --link-mbit / --link-delay-ms): rate per
    phone and direction (None: unshaped) and one-way latency. Kept in run.json for --resume."""
    mbit: float | None = None
    delay_ms: float = 0.0
    netns_tag: str | None = None  # the phones' namespaces, once made

    def open(self, n: int) -> tuple["ShapedNetwork | None", list[str], str]:
        """(the phones' network or None, zl-phone arguments, how the links are shaped, in words).
        A rate puts every phone in its own shaped namespace where the machine allows it, else on
        loopback behind the transport's rate limiter; on resume the same namespaces are taken over."""
        from . import netns

        args = ["--link-delay-ms", f"{self.delay_ms:g}"] if self.delay_ms else []
        latency = f", {self.delay_ms:g} ms one-way latency" if self.delay_ms else ""
        if not self.mbit:
            return None, args, "loopback, unshaped" + latency
        why = netns.unavailable()
        if why is not None:
            return None, args + ["--rate-mbit", f"{self.mbit:g}"], \
                f"loopback, the transport's rate limiter at {self.mbit:g} Mbit/s ({why})" + latency
        if self.netns_tag:
            network = netns.ShapedNetwork(n, self.mbit, tag=self.netns_tag).reopen()
        else:
            network = netns.ShapedNetwork(n, self.mbit).open()
        self.netns_tag = network.tag
        return network, args, f"own network namespaces, {self.mbit:g} Mbit/s per phone and direction" + latency


def budget_args(share: float) -> list[str]:
    """zl-phone arguments of a phone held to `share` of one core: not pinned (the shares of several
    phones need not add up to whole cores); the phone picks its threads from the share."""
    return ["--cpu-share", f"{share:g}"]


def phone_class(runtime: str):
    """The emulated phone of a runtime: zl-phone ("python") or the Kotlin core on the JVM ("kotlin")."""
    if runtime == "kotlin":
        from .kotlin_phone import KotlinPhone

        return KotlinPhone
    return EmulatedPhone


def start_phones(n: int, root: Path, prefix: str = "emu", extra_args=None, per_phone_args=None,
                 network: "ShapedNetwork | None" = None, cpu_shares: list[float] | None = None,
                 runtimes: list[str] | None = None) -> list[EmulatedPhone]:
    """Start n phones; with 2+ cores each phone is pinned to its own core (round robin), or, with
    `cpu_shares`, phone i is held to cpu_shares[i] of one core (zl-phone --cpu-share) instead.
    With `network` (an open host.phones.netns.ShapedNetwork of n phones) phone i runs in its namespace.
    `runtimes[i]` ("python" or "kotlin", host/phones/kotlin_phone.py) says what phone i runs."""
    phones = []
    cores = sorted(os.sched_getaffinity(0))
    try:
        for i in range(n):
            args = list(extra_args or [])
            if per_phone_args:
                args += per_phone_args(i)
            elif cpu_shares:
                args += budget_args(cpu_shares[i])
            elif len(cores) > 1:
                args += ["--cpus", str(cores[i % len(cores)]), "--threads", "1"]
            net = network.phones[i] if network else None
            cls = phone_class(runtimes[i] if runtimes else "python")
            phones.append(cls(f"{prefix}{i}", Path(root) / f"{prefix}{i}", secrets.token_hex(32), args,
                              net=net).start())
    except BaseException:
        for p in phones:
            p.stop()
        raise
    return phones


def run_on_emulated_phones(export_dir: Path, root: Path, settings, micro_batches, n_phones: int = 3, *,
                           prefix: str = "emu", run_id: str = "local", extra_args=None, per_phone_args=None,
                           network: "ShapedNetwork | None" = None, cpu_shares: list[float] | None = None,
                           coordinator_cls=None, on_event=None, phones_out: list | None = None):
    """One training run on this machine, start to end: n emulated phones started under root/phones
    (start_phones' arguments), one coordinator run over them (root/run; `coordinator_cls`: a
    Coordinator subclass), the phones stopped whatever happens. `phones_out`, if given, receives the
    phones (a caller that kills one needs its process). What tests and benchmarks run a pipeline with.
    Returns (result, the run's metrics records)."""
    import json

    from ..run.coordinator import Coordinator

    phones = start_phones(n_phones, Path(root) / "phones", prefix=prefix, extra_args=extra_args,
                          per_phone_args=per_phone_args, network=network, cpu_shares=cpu_shares)
    if phones_out is not None:
        phones_out.extend(phones)
    try:
        co = (coordinator_cls or Coordinator)(export_dir, [p.handle() for p in phones], micro_batches, settings,
                                              Path(root) / "run", run_id=run_id, on_event=on_event)
        result = co.run()
    finally:
        for p in phones:
            p.stop()
    records = [json.loads(line) for line in (Path(root) / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, records


def cpu_shares(text: str | None, n: int) -> list[float] | None:
    """--cpu-share F|F1,...,Fn for n emulated phones (None: unbudgeted); checked before anything starts."""
    if text is None:
        return None
    from zl_mobile.cpu_budget import CpuBudgetError, parse_shares, unavailable

    try:
        shares = parse_shares(text, n)
    except CpuBudgetError as e:
        raise CliError(str(e)) from None
    why = unavailable()
    if why is not None:
        raise CliError(f"--cpu-share: {why}")
    return shares
