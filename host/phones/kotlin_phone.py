"""Kotlin phones: the app's core (kotlin_app/core: protocol, links, stage runtime, AdamW,
checkpoints) on the JVM, running chunks through ExecuTorch's C++ runtime (kotlin_app/jni), started
as real processes the way zl-phone is (host/phones/emulate.py). What ships to phones, minus its Android
layer, trains in the same pipelines as Python phones: `--runtime kotlin` or a mix per phone."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..cli.error import CliError
from .emulated_phone import EmulatedPhone, EmulatorError

ROOT = Path(__file__).resolve().parents[2]
KOTLIN_APP = ROOT / "kotlin_app"
RUNTIMES = ("python", "kotlin")
# the JVM's own share of a phone's memory kept small, as on a phone: tensors move through
# ExecuTorch's memory (kept activations) and small heap arrays; SerialGC adds no GC threads. A small
# young generation: the default (a third of 1/64 of the machine's RAM) is touched page by page as
# frames are allocated, which grew a tiny-model phone's PSS by ~80 MiB over 90 windows before its
# first collection (bench/kotlin_phone.py: peak 193 -> 98 MiB, step time unchanged)
JVM_OPTIONS = ["-Xmx512m", "-Xms16m", "-Xmn8m", "-XX:+UseSerialGC", "-Xshare:auto"]
# zl-phone options a Kotlin phone takes as they are; the others are turned into a launcher or refused
PASSED = {"--threads", "--mem-limit", "--rate-mbit", "--link-delay-ms"}  # the same meanings (DeviceMain)
FLAGS_IGNORED = {"--mdns"}  # the JVM phone does not advertise itself; `zl-host emulate` does it for it
# HEARTBEAT to the host this often, zl-phone's period: a stage waiting for its neighbour (one restarting
# after a failure) stays heard, and a silent phone (an in-app failure, detect=heartbeat) stands out
HEARTBEAT_MS = 500


def parse_runtimes(text: str | None, n: int) -> list[str]:
    """--runtime python|kotlin, or one per phone (python,kotlin,python) for n phones."""
    if text is None:
        return ["python"] * n
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if p not in RUNTIMES]
    if bad:
        raise CliError(f"--runtime {text!r}: {bad[0]!r} is not a phone runtime; use python or kotlin, one for all "
                       "phones or one per phone (e.g. python,kotlin,python)")
    if len(parts) == 1:
        return parts * n
    if len(parts) != n:
        raise CliError(f"--runtime {text!r} names {len(parts)} runtimes for {n} phones: give one for all or one per phone")
    return parts


def classpath(build: bool = True) -> tuple[str, Path]:
    """(the Kotlin core's class path, the ExecuTorch bridge library), built by kotlin_app/run_tests.sh
    --build-only when missing or stale (it never installs here: a missing toolchain is an error)."""
    cp_file = KOTLIN_APP / "build" / "classpath.txt"
    lib = KOTLIN_APP / "build" / "native" / "libzl_executorch.so"
    if build:
        r = subprocess.run(["bash", str(KOTLIN_APP / "run_tests.sh"), "--build-only", "--no-install"], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            why = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise EmulatorError(f"cannot build the Kotlin phone ({why[0]}): run `bash kotlin_app/run_tests.sh` once "
                                "(it installs kotlinc from npm and builds the ExecuTorch bridge)")
    if not cp_file.is_file() or not lib.is_file():
        raise EmulatorError("the Kotlin phone is not built: run `bash kotlin_app/run_tests.sh --build-only`")
    return cp_file.read_text().strip(), lib


_BUILT: tuple[str, Path] | None = None


def _built() -> tuple[str, Path]:
    global _BUILT
    if _BUILT is None:  # once per host process: the build check takes a few seconds
        _BUILT = classpath()
    return _BUILT


def java_command(name: str, workdir: Path, token: str, port: int, bind: str, extra_args: list[str]) -> list[str]:
    """The Kotlin phone's command line for zl-phone's arguments: --cpus becomes taskset, --cpu-share
    the same CPU-budget launcher zl-phone is started under (and threads for the share)."""
    cp, lib = _built()
    args, prefix, i = [], [], 0
    while i < len(extra_args):
        opt = extra_args[i]
        val = extra_args[i + 1] if i + 1 < len(extra_args) else None
        if opt in PASSED:
            args += [opt, val]
        elif opt == "--cpus":
            prefix = ["taskset", "-c", val] + prefix
        elif opt == "--cpu-share":
            from zl_mobile.cpu_budget import threads_for_share

            prefix = [sys.executable, "-m", "zl_mobile.cpu_budget", val, "--"] + prefix
            args += ["--cpu-share", val]  # for HELLO's cpu_share, as zl-phone reports its budget
            if "--threads" not in extra_args:
                args += ["--threads", str(threads_for_share(float(val)))]
        elif opt in FLAGS_IGNORED:
            pass
        else:
            raise EmulatorError(f"{opt} is a zl-phone option Kotlin phones do not have yet: run those phones with "
                                "--runtime python")
        i += 2
    return [*prefix, "java", *JVM_OPTIONS, f"-Dzerolock.executorchJni={lib}", "-cp", cp, "org.zerolock.core.device.DeviceMain",
            "--runtime", "executorch", "--name", name, "--workdir", str(workdir), "--token", token, "--port", str(port),
            "--bind", bind, "--heartbeat-ms", str(HEARTBEAT_MS), "--detach", *args]


class KotlinPhone(EmulatedPhone):
    """An emulated phone whose process is the Kotlin core on the JVM (org.zerolock.core.device.DeviceMain)."""

    runtime = "kotlin"
    advertises = False  # no mDNS responder of its own: ready once it listens

    def start(self, timeout: float = 60.0) -> "KotlinPhone":
        # the token kept in the work dir, where zl-phone keeps its own and `--devices auto` reads it
        # (host/devices/discovery.py load_tokens); the app keeps it in its storage and shows it, the JVM phone prints it
        from zl_mobile.phone import load_or_create_token

        self.workdir.mkdir(parents=True, exist_ok=True)
        load_or_create_token(self.workdir, self.token)
        return super().start(timeout)

    def command(self) -> list[str]:
        if self.net is not None:
            raise EmulatorError("Kotlin phones do not run in network namespaces yet (--link-mbit): use --runtime python")
        return java_command(self.name, self.workdir, self.token, self.port, self.address, self.extra_args)


def advertise(phones) -> list:
    """mDNS records for the Kotlin phones among `phones`, held by the caller (zl-host emulate) while
    they run: on Android NsdManager advertises the app; on the JVM the host does it for the phone."""
    from zl_mobile.mdns import Advertisement

    ads = []
    for p in phones:
        if getattr(p, "runtime", "python") == "kotlin":
            ads.append(Advertisement(p.name, p.port, txt_for(p), addresses=[p.address]))
    return ads


def txt_for(phone) -> dict[str, str]:
    """A Kotlin phone's TXT record: zl-phone's, `cpu_share` included when it is held to one."""
    from zl_mobile.mdns import PROTO, txt_record
    from zl_mobile.telemetry import total_memory_bytes

    args = phone.extra_args
    share = float(args[args.index("--cpu-share") + 1]) if "--cpu-share" in args else None
    return txt_record(phone.name, PROTO, "kotlin/executorch", total_memory_bytes(), cpu_share=share)

