"""`zl-host run`, given a RunConfig: resolve what to train (a new run or the one to resume), bring
up the phones (emulated, on mDNS or on adb), train with the live view, then write the adapter,
summary and report. Each step is a function of its own; the CLI only builds the config."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from ..cli.error import CliError
from .config import RunConfig, emulated_count

console = Console(stderr=True, soft_wrap=True)


def say(line: str) -> None:
    console.print(line, markup=False)


@dataclass
class Job:
    """A run resolved from its config (or from the run.json of the run it resumes)."""
    program: Path
    data: str | None
    devices: str
    held_out: float
    run_id: str
    run_dir: Path
    manifest: dict
    train: list
    settings: object                 # host.run.settings.RunSettings
    links: object                    # host.phones.emulate.EmulatedLinks
    saved: dict = field(default_factory=dict)  # the resumed run's run.json ({} for a new run)
    plan: dict | None = None
    plan_path: str | None = None

    @property
    def stages(self) -> int:
        return len(self.manifest["chunks"])


@dataclass
class Devices:
    """What a run trains on and what must be undone when it ends."""
    handles: list
    phones: list = field(default_factory=list)  # emulated phones this run started or adopted
    network: object = None                       # their shaped network, if any
    adb: object = None                           # host.devices.adb_wiring.AdbLinks for phones on USB
    adb_events: list = field(default_factory=list)

    def close(self, coordinator=None) -> None:
        for p in self.phones:
            p.stop()
        if self.network is not None:
            self.network.close()
        if self.adb is not None:  # remove the adb forwards and reverses this run made
            if coordinator is not None:
                coordinator.stop_sampling()
            for problem in self.adb.close():
                say(f"zl-host: warning: {problem}")


def run(cfg: RunConfig) -> Path:
    """Train as `cfg` says; returns the run directory."""
    job = resolve(cfg)
    devices = bring_up(cfg, job)
    result, watch = train(cfg, job, devices)
    write_outputs(job, result, watch)
    return job.run_dir


# ---------------------------------------------------------------- resolve
def _load_resume(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except FileNotFoundError:
        raise CliError(f"cannot resume: {run_dir} has no run.json (not a zl-host run dir); "
                       "give the --out of an earlier run") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"cannot resume: {run_dir / 'run.json'} is unreadable ({e}); start a new run instead") from None


def resolve(cfg: RunConfig) -> Job:
    """Program, data split, settings and plan, checked before any phone starts."""
    from exporter.manifest import ManifestError, load_manifest

    from ..evaluation.evaluate import split_held_out
    from ..phones.emulate import EmulatedLinks
    from .data import prepare_data
    from .settings import PlanError, RunSettings

    saved: dict = {}
    if cfg.resume:
        run_dir = Path(cfg.resume)
        saved = _load_resume(run_dir)
        program, data, devices = Path(saved["program"]), saved["data"], saved["devices"]
        held_out = saved.get("held_out", cfg.held_out)
        settings = RunSettings(**saved["settings"])
        run_id = saved["run_id"]
        links = EmulatedLinks(**saved.get("link") or {})  # a resumed run keeps its links
    else:
        if not cfg.program:
            raise CliError("--program DIR is required (the output of zl-export)")
        program, data, devices, held_out = Path(cfg.program), cfg.data, cfg.devices, cfg.held_out
        n_emulated = cfg.emulated_count()  # before anything is loaded
        if cfg.runtime is not None:
            if n_emulated is None:
                raise CliError("--runtime picks what emulated phones run: use --devices emulated:N (a real phone runs the app)")
            from ..phones.kotlin_phone import parse_runtimes
            parse_runtimes(cfg.runtime, n_emulated)
        run_dir = Path(cfg.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        settings = None
        links = EmulatedLinks(cfg.link_mbit, cfg.link_delay_ms)
    try:
        manifest = load_manifest(program)
    except ManifestError as e:
        raise CliError(str(e)) from None
    train, _ = split_held_out(prepare_data(program, manifest, data, warn=say), held_out)
    if settings is None:
        settings = cfg.settings(len(train))
    job = Job(program, data, devices, held_out, run_id, run_dir, manifest, train, settings, links, saved)
    job.plan_path = saved.get("plan") if cfg.resume else cfg.plan  # a resumed run keeps its stage order
    if job.plan_path:
        from ..cli.plan import check_plan_export, read_plan
        job.plan = check_plan_export(read_plan(Path(job.plan_path)), manifest, job.plan_path, program)
        if job.devices == "auto":
            job.devices = ",".join(job.plan["devices"])
    try:
        settings.checked_horizon(job.stages)  # before any phone starts
        settings.checked_per_stage(job.stages)
    except PlanError as e:
        raise CliError(str(e)) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    return job


# ---------------------------------------------------------------- devices
def bring_up(cfg: RunConfig, job: Job) -> Devices:
    if job.devices.startswith("emulated:"):
        return _emulated(cfg, job, emulated_count(job.devices))
    if cfg.cpu_share is not None:
        raise CliError("--cpu-share budgets emulated phones only: use --devices emulated:N")
    if job.links.mbit or job.links.delay_ms:
        raise CliError("--link-mbit / --link-delay-ms shape emulated phones' links only: use --devices emulated:N")
    return _real(cfg, job)


def _emulated(cfg: RunConfig, job: Job, n: int) -> Devices:
    from ..phones.emulate import cpu_shares, phone_class, start_phones
    from ..phones.kotlin_phone import parse_runtimes
    from ..phones.netns import NetnsError

    if n < job.stages:
        raise CliError(f"{n} emulated phone(s) for {job.stages} chunks: use --devices emulated:{job.stages}")
    shares = None if cfg.resume else cpu_shares(cfg.cpu_share, n)  # a resumed run's phones keep their arguments
    runtimes = parse_runtimes(cfg.runtime, n)
    try:
        network, phone_args, how = job.links.open(n)
    except NetnsError as e:
        raise CliError(f"cannot make the phones' network: {e}; run without --link-mbit") from None
    try:
        if cfg.resume and job.saved.get("phones"):
            phones = [phone_class(p.get("runtime", "python"))(p["name"], Path(p["workdir"]), p["token"], p["args"],
                                                              p["port"], net=network.phones[i] if network else None)
                      .adopt_or_start(p.get("pid"))
                      for i, p in enumerate(job.saved["phones"])]
        else:
            say(f"starting {n} emulated phones ({how})")
            per_phone = None
            if cfg.mem_limit:  # the phones' CPU budget or core, and their memory limit
                from ..cli.plan import check_mem_limits, emulated_phone_args, parse_list
                limits = parse_list(cfg.mem_limit, n, "memory limit", "--mem-limit")
                check_mem_limits(limits)
                per_phone = emulated_phone_args(n, limits, shares)
            phones = start_phones(n, job.run_dir / "phones", extra_args=phone_args, network=network,
                                  per_phone_args=per_phone, cpu_shares=shares, runtimes=runtimes)
    except BaseException:
        if network is not None:
            network.close()
        raise
    return Devices([p.handle() for p in phones], phones=phones, network=network)


def _real(cfg: RunConfig, job: Job) -> Devices:
    from ..devices.adb_wiring import AdbLinks
    from ..devices.discovery import DeviceLookupError, load_tokens
    from ..devices.discovery import resolve as resolve_devices

    events: list = []  # the live view does not exist yet when the control ports are forwarded
    adb = AdbLinks(data_port=cfg.adb_data_port, staging_dir=cfg.adb_staging,
                   on_event=lambda kind, data: events[-1](kind, data) if events else None)
    try:
        from ..devices.problems import min_chunk_bytes
        handles = resolve_devices(job.devices, job.stages, load_tokens(cfg.tokens), cfg.wait, cfg.mdns, links=adb,
                                  min_bytes=min_chunk_bytes(job.program, job.manifest, job.settings.schedule))
    except DeviceLookupError as e:
        adb.close()
        raise CliError(str(e)) from None
    return Devices(handles, adb=adb, adb_events=events)


# ---------------------------------------------------------------- train
def _write_run_record(job: Job, devices: Devices, co) -> None:
    """run.json, from which --resume continues (written before training: it holds pairing tokens)."""
    record = {"program": str(job.program.absolute()), "data": job.data, "held_out": job.held_out,
              "devices": job.devices, "run_id": job.run_id,
              "settings": job.settings.to_json(), "link_tokens": co.link_tokens, "link": asdict(job.links),
              **({"plan": str(Path(job.plan_path).absolute())} if job.plan is not None else {}),
              "phones": [{"name": p.name, "workdir": str(p.workdir), "token": p.token, "args": p.extra_args,
                          "port": p.port, "pid": p.pid, "runtime": p.runtime} for p in devices.phones]}
    tmp = job.run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.chmod(0o600)  # holds pairing tokens
    tmp.replace(job.run_dir / "run.json")


def train(cfg: RunConfig, job: Job, devices: Devices):
    """The coordinator's run under the live view; returns (its result, the plan's drift watch or None).
    The devices are closed whatever happens."""
    from rich.live import Live

    from .coordinator import Coordinator, RunError
    from .live import LiveView
    from .settings import PlanError

    view = LiveView(job.stages, job.settings.micro_batches, job.manifest["export"]["micro_batch"])
    if devices.adb is not None:
        devices.adb_events.append(view.on_event)
    from .tensorboard_log import RunEvents

    listeners = [view.on_event]  # the live view, TensorBoard's events and, with a plan, its drift watch

    def on_event(kind, data):
        for listen in listeners:
            listen(kind, data)
    watch = board = co = None
    handles = devices.handles
    try:
        board = RunEvents(job.run_dir, job.manifest["export"]["micro_batch"])  # tensorboard --logdir runs, live
        listeners.append(board.on_event)
        if job.plan is not None:
            from ..cli.plan import drift_watch, order_by_plan
            watch = drift_watch(job.plan, cfg.drift_margin, job.settings.window_size, job.run_dir, say)
            listeners.append(watch.on_event)
            handles = order_by_plan(handles, job.plan)  # the plan's phones in its stage order
        co = Coordinator(job.program, handles, job.train, job.settings, job.run_dir, run_id=job.run_id,
                         on_event=on_event, link_tokens=job.saved.get("link_tokens") if cfg.resume else None,
                         links=devices.adb, keep_order=job.plan is not None)
        _write_run_record(job, devices, co)
        try:
            with Live(view, console=console, refresh_per_second=4, transient=False):
                result = co.run()
        finally:
            if not console.is_terminal:  # rich leaves the last table line open when not on a terminal
                console.line()
    except (PlanError, RunError) as e:
        raise CliError(str(e)) from None
    finally:
        if board is not None:
            board.close()
        devices.close(co)
    return result, watch


# ---------------------------------------------------------------- outputs
def write_outputs(job: Job, result: dict, watch=None) -> None:
    """adapter/ (PEFT), summary.json and report.md with its plots."""
    from exporter.errors import ExportError

    from ..outputs.adapter import base_model_path, write_peft_adapter
    from .report import write_report

    try:
        base = base_model_path(job.program, job.manifest)
    except ExportError:  # --model smollm2, its wheel not on this host: the path the export recorded
        base = job.manifest["model"].get("path")
    adapter_dir = write_peft_adapter(result["lora"], job.manifest, job.run_dir / "adapter", base)
    s = job.settings
    rows = s.micro_batches * job.manifest["export"]["micro_batch"]
    summary = {"run_id": job.run_id, "program": str(job.program), "data": job.data or "synthetic",
               "windows": s.windows, "window_size": s.window_size, "micro_batches": s.micro_batches, "lr": s.lr,
               "seconds": result["seconds"], "samples_per_s": rows / result["seconds"],
               "recoveries": len(result["recoveries"]), "link_bytes": result["link_bytes"], "errors": result["errors"],
               "forward_only_stages": s.forward_only_stages(job.stages)}
    if watch is not None:
        plan = job.plan
        summary["plan"] = {"file": str(Path(job.plan_path).absolute()), "chunks": plan["chunks"],
                           "devices": plan["devices"], "predicted_s": [st["time_s"] for st in plan["stages"]],
                           "drift_reports": watch.reports}
    (job.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    report = write_report(job.run_dir, summary)
    console.print(f"adapter: {adapter_dir}  report: {report}  metrics: {job.run_dir / 'metrics.jsonl'}")
