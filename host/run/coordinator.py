"""The coordinator: wires the stages, feeds stage 0, watches heartbeats, recovers failed stages
and gathers the trained LoRA. Hidden states go device to device; the host only coordinates."""
from __future__ import annotations

import json
import logging
import queue
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from zl_common.manifest import ChunkEntry, Manifest, ManifestError
from zl_mobile.backends import EAGER_CAPABILITY
from zl_mobile.links import OutboundLink
from zl_mobile.protocol import Message, MsgType

from .client import DeviceClient, DeviceError, Event, open_session
from .settings import RunSettings, assign_by_memory

log = logging.getLogger("host.coordinator")


class RunError(Exception):
    pass


@dataclass
class DeviceHandle:
    """A device the run may use. `restart` is set for emulated phones (the host owns the process)."""
    name: str
    endpoint: str
    token: str
    memory_bytes: int = 0
    restart: Callable[[], str] | None = None  # returns the new endpoint
    alive: Callable[[], bool] | None = None  # emulated: the phone process still runs (try it before a restart)
    serial: str | None = None  # set for phones reached over adb (USB): endpoint is an adb forward


@dataclass
class StageState:
    k: int
    device: DeviceHandle
    client: DeviceClient | None = None
    meta: dict = field(default_factory=dict)
    data_port: int = 0
    committed: int = -1
    last_mb: int = -1
    failed_at: float | None = None
    bytes_banked: int = 0   # link bytes sent by earlier incarnations of this stage
    bytes_out: int = 0      # ... and by the current one


class Coordinator:
    def __init__(self, export_dir: Path, devices: list[DeviceHandle], micro_batches: list[dict],
                 settings: RunSettings, run_dir: Path, run_id: str | None = None, on_event=None,
                 link_tokens: list[str] | None = None, links=None, keep_order: bool = False, sink=None):
        self.export_dir = Path(export_dir)
        self.manifest = Manifest.load(self.export_dir)
        self.chunks = self.manifest.chunks
        self.settings = settings
        self.micro_batches = micro_batches
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or time.strftime("run-%Y%m%d-%H%M%S")
        self.events: "queue.Queue[Event]" = queue.Queue()
        self.on_event = on_event or (lambda kind, data: None)
        self.files = self.manifest.files
        sizes = {p: f.size for p, f in self.files.items()}
        # refused before any phone is touched if it could not cover a failure (PlanError)
        self.horizon = settings.checked_horizon(len(self.chunks))
        # each chunk's entry for the schedule: an export without its programs is refused here, before any phone
        self.entries = [self._entry(k) for k in range(len(self.chunks))]
        # keep_order: devices[k] runs chunk k (a zl-host plan chose them); else by the memory of the program each runs
        ordered = devices[:len(self.chunks)] if keep_order else assign_by_memory(self.entries, devices, sizes)
        self.stages = [StageState(k, d) for k, d in enumerate(ordered)]
        # token of the link into stage k; kept in run.json so a resumed host reaches running stages
        self.link_tokens = link_tokens or [secrets.token_hex(32) for _ in range(len(self.chunks))]
        self.metrics = open(self.run_dir / "metrics.jsonl", "a")
        self.feeder: OutboundLink | None = None
        self.errors: list[str] = []
        self.fatal: list[str] = []  # errors a stage marked fatal: the run stops with them
        self.recoveries: list[dict] = []
        self.started = time.time()
        self.last_progress = self.started  # the last micro-batch or commit any stage reported
        # adb phones (host.devices.adb_wiring.AdbLinks): forwards, reverses, adb push, dumpsys sampling
        self.links = links
        self.sampler = None
        # a host-side downstream for the last stage (host.planning.calibration_sink: a calibration stage
        # sends its hidden states as a stage with a next one does)
        self.sink = sink

    # ---- setup
    def _connect(self, st: StageState, timeout: float = 10.0) -> None:
        try:
            st.client = open_session(st.device.name, st.device.endpoint, st.device.token, self.events, timeout)
        except OSError as e:  # ConnectionClosed too
            if st.device.serial is None:
                raise
            # an adb forward accepts the connection even when nothing listens on the phone
            raise DeviceError(f"{st.device.name} (adb {st.device.serial}): nothing answered on the app's port "
                              f"through adb forward {st.device.endpoint} ({type(e).__name__}: {e}); open ZeroLock on "
                              "the phone and tap Start serving") from None
        from zl_mobile.protocol import PROTOCOL_VERSION
        if st.client.hello["protocol_version"] != PROTOCOL_VERSION:
            raise RunError(f"{st.device.name} speaks protocol {st.client.hello['protocol_version']}, this host "
                           f"{PROTOCOL_VERSION}: "
                           "update the app or zl_mobile on the device")

    def _entry(self, k: int) -> ChunkEntry:
        """Chunk k's entry for the run's schedule (BP baselines run the chunk's BP program)."""
        try:
            return self.chunks[k].for_schedule(self.settings.schedule)
        except ManifestError as e:
            raise RunError(f"schedule {self.settings.schedule}: {e}") from None

    def _push(self, st: StageState) -> None:
        chunk = self.entries[st.k]
        if EAGER_CAPABILITY in (st.client.hello.get("capabilities") or []):  # runs the chunk in eager PyTorch
            runtime = [(chunk.eager_weights, "weights")] if chunk.eager_weights is not None else []  # else it says: re-export
        else:
            runtime = [(chunk.program, "program"), (chunk.weights, "weights")]
        for rel, kind in [("manifest.json", "manifest"), *runtime, (chunk.lora_init, "other")]:
            sha = self.files[rel].sha256 if rel in self.files else _sha(self.export_dir / rel)
            sent, via = None, "protocol"
            if st.device.serial is not None and self.links is not None:
                from ..devices.adb import AdbCommandError
                from ..devices.adb_wiring import AdbPushUnavailable
                try:
                    sent, via = self.links.push(st.device.serial, self.export_dir / rel, sha), "adb"
                except AdbPushUnavailable as e:
                    if rel == "manifest.json":  # once per stage: say why the slower path is used
                        self.on_event("adb_push_fallback", {"stage": st.k, "device": st.device.name, "why": str(e)})
                except AdbCommandError as e:
                    raise RunError(f"stage {st.k}: {e}") from None
            if sent is None:
                sent = st.client.push_file(self.export_dir / rel, kind, sha)
            self.on_event("push", {"stage": st.k, "device": st.device.name, "file": rel, "sent": sent, "via": via})

    def _address(self, up: StageState | None, down: StageState) -> str:
        """Where ``up`` (None: the host's feed) connects to reach ``down``'s data port."""
        if self.links is None:
            return f"{down.client.address}:{down.data_port}"
        from ..devices.adb import AdbCommandError
        from ..devices.adb_wiring import WiringError
        try:
            return self.links.address(up.device if up else None, down.device, down.client.address, down.data_port)
        except (WiringError, AdbCommandError) as e:
            raise RunError(str(e)) from None

    def _assign(self, st: StageState, rollback_to: int | None = None) -> None:
        s = self.settings
        nxt = self.stages[st.k + 1] if st.k + 1 < len(self.stages) else None
        # every field is sent, so no device default decides a run (PROTOCOL.md 5.3); only
        # keep_checkpoints is left to the device unless the run needs more (the Kotlin core keeps one)
        conf = {"lr": s.lr_for(st.k), "weight_decay": s.weight_decay, "alpha": s.alpha_for(st.k),
                "total_micro_batches": s.micro_batches, "busy_ms": int(s.compute_timeout * 1000),
                "restart": False, "rollback_to_window": None,
                "inject_failure": [{"window": f.get("window"), "point": f.get("point", "after-phase1"),
                                    **{k: f[k] for k in ("seconds", "mode", "detect") if k in f}}
                                   for f in (s.inject_failure or []) if f.get("stage") == st.k]}
        if s.recovery == "global-rollback":  # every stage must still hold the last globally consistent checkpoint
            conf["keep_checkpoints"] = self.horizon // s.window_size + 3
        if s.keep_checkpoints:
            conf["keep_checkpoints"] = max(conf.get("keep_checkpoints", 0), s.keep_checkpoints)
        st.meta = {
            "run_id": self.run_id, "stage": st.k, "num_stages": len(self.stages),
            "upstream": "host" if st.k == 0 else self.stages[st.k - 1].device.endpoint,
            "downstream": self._address(st, nxt) if nxt else None,
            "program_sha256": self.files[self.entries[st.k].program].sha256,
            "window_size": s.window_size, "inflight_depth": s.inflight_depth, "replay_horizon": self.horizon,
            "buffer_capacity": s.inflight_depth, "schedule": s.schedule,
            "upstream_token": self.link_tokens[st.k], "config": conf,
        }
        if nxt:
            st.meta["downstream_token"] = self.link_tokens[st.k + 1]
        elif self.sink is not None:
            st.meta["downstream"], st.meta["downstream_token"] = self.sink.address(st.client), self.sink.token
        listen = self.links.listen_port(st.device) if self.links is not None else None
        st.meta["listen_port"] = listen or 0  # 0: any port, the device says which in its ACK
        meta = st.meta
        if rollback_to is not None:
            meta = {**meta, "config": {**conf, "restart": True, "rollback_to_window": rollback_to}}
        ack = st.client.assign(meta)
        st.data_port = ack.get("data_port") or listen
        if not st.data_port:
            raise RunError(f"{st.device.name} did not say which port its stage listens on (no data_port in the "
                           "STAGE_ASSIGN ACK): update the app on the phone")
        st.committed = ack.get("committed_window", -1)

    def _rejoining_once(self, st: StageState, step) -> None:
        """`step(st)`; if the session is lost meanwhile (dropped, or ended by the device because a frame
        did not open: PROTOCOL.md 6.1), the device is rejoined as after a failure and the step runs
        again, once. A refusal (an ERROR with a code) is the device's answer, not retried."""
        try:
            step(st)
        except (OSError, DeviceError) as e:
            if isinstance(e, DeviceError) and e.code is not None:
                raise
            self.on_event("waiting", {"stage": st.k, "device": st.device.name, "error": str(e)})
            st.client.close()
            self._rejoin(st, str(e), time.time())
            if step != self._push:
                self._push(st)
            step(st)

    def setup(self) -> None:
        for st in self.stages:
            try:
                self._connect(st)
            except DeviceError as e:
                raise RunError(str(e)) from None
            self.on_event("connected", {"stage": st.k, "device": st.device.name, "hello": st.client.hello.meta})
            # what the device said about itself (cores, CPU budget, runtime) goes into the metrics for the report
            self.metrics.write(json.dumps({"t": time.time(), "device": st.device.name, "stage": st.k, "type": "HELLO",
                                           **{k: v for k, v in st.client.hello.meta.items() if k != "files"}}) + "\n")
        for st in self.stages:
            self._rejoining_once(st, self._push)
        for st in reversed(self.stages):  # downstream first: each needs its neighbour's data port
            self._rejoining_once(st, self._assign)
        # the feed builds each input when stage 0's credits let it go: it holds none, and it can
        # serve any replay (a restarted stage 0, a global rollback) from the data set
        self.feeder = OutboundLink("host-feed", self.link_tokens[0], window_size=self.settings.window_size,
                                   replay_horizon=self.horizon, on_error=self._error, source=self._input_frame,
                                   source_total=self.settings.micro_batches)
        self.feeder.set_address(self._address(None, self.stages[0]))
        if self.links is not None:
            from ..devices.adb_wiring import AdbSampler
            self.sampler = AdbSampler(self.links, {s.device.name: s.device.serial for s in self.stages
                                                   if s.device.serial}, self._sampled).start()

    def _sampled(self, device: str, meta: dict) -> None:
        """A dumpsys sample (PSS, battery temperature) read over adb: into the event queue, so the
        main loop writes it to the metrics ("kind": "adb_dumpsys")."""
        self.events.put(Event(device, Message(MsgType.TELEMETRY, meta), time.time()))

    def _input_frame(self, mb: int) -> Message:
        b = self.micro_batches[mb % len(self.micro_batches)]
        return Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // self.settings.window_size},
                       {"h": b["input_ids"], "attention_mask": b["attention_mask"], "position_ids": b["position_ids"],
                        "labels": b["labels"]})

    def _error(self, text: str) -> None:
        self.errors.append(text)
        self.on_event("error", {"message": text})

    # ---- main loop
    def run(self) -> dict:
        self.setup()
        self.last_progress = time.time()  # pushing programs is no stall
        last = self.settings.windows - 1
        while any(st.committed < last for st in self.stages):
            try:
                ev = self.events.get(timeout=0.5)
            except queue.Empty:
                ev = None
            if ev is not None:
                self._handle(ev)
            self._check_heartbeats()
            if self.settings.max_seconds and time.time() - self.started > self.settings.max_seconds:
                raise RunError(f"the run did not finish within {self.settings.max_seconds:.0f} s "
                               f"(committed windows per stage: {[s.committed for s in self.stages]}); "
                               f"see the phone logs, then zl-host run --resume {self.run_dir}")
            if self.fatal:
                raise RunError(f"{self.fatal[0]}; once that is fixed, continue with zl-host run --resume {self.run_dir}")
            self._check_stalled()
        return self.finish()

    def _check_stalled(self) -> None:
        """No run stops without saying why: if no stage has reported progress for stall_after
        seconds while all answer heartbeats, stop and say where each one stands."""
        quiet = time.time() - self.last_progress
        if quiet <= self.settings.stall_after:
            return
        where = "; ".join(f"stage {s.k} ({s.device.name}): committed window {s.committed}, last micro-batch {s.last_mb}"
                          for s in self.stages)
        raise RunError(f"no stage made progress for {quiet:.0f} s though all answer heartbeats ({where}); see the "
                       f"phone logs, then zl-host run --resume {self.run_dir}")

    def _stage_of(self, device_name: str) -> StageState:
        return next(st for st in self.stages if st.device.name == device_name)

    def _handle(self, ev: Event) -> None:
        st = self._stage_of(ev.device)
        if ev.msg is None:
            if st.client is not None and not st.client.alive and st.failed_at is None:
                self._recover(st, "connection lost")
            return
        msg = ev.msg
        rec = {"t": ev.at, "device": ev.device, "stage": st.k, "type": msg.type.name, **msg.meta}
        if msg.type in (MsgType.TELEMETRY, MsgType.CHECKPOINT_COMMITTED) and msg.get("kind") != "adb_dumpsys":
            self.last_progress = time.time()
        if msg.type == MsgType.TELEMETRY and msg.get("kind", "micro_batch") == "micro_batch":  # "window" records carry deltas
            st.last_mb = max(st.last_mb, msg.get("micro_batch", -1))
            out = msg.get("bytes_out", 0)
            if out < st.bytes_out:  # a new incarnation of the stage started counting from zero
                st.bytes_banked += st.bytes_out
            st.bytes_out = out
            self._check_caught_up()
        elif msg.type == MsgType.CHECKPOINT_COMMITTED:
            st.committed = max(st.committed, msg["window"])
        elif msg.type == MsgType.ERROR:
            text = f"{ev.device} (stage {st.k}): {msg['message']}"
            self._error(text)
            if msg.get("fatal"):
                self.fatal.append(text)
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        self.on_event(msg.type.name.lower(), rec)

    def _check_heartbeats(self) -> None:
        now = time.time()
        for st in self.stages:
            if (st.client is not None and st.failed_at is None and now > st.client.quiet_until
                    and now - st.client.last_heard > self.settings.heartbeat_timeout):
                self._recover(st, f"no heartbeat for {now - st.client.last_heard:.1f} s")

    # ---- recovery (the seed's Algorithm 3): only the failed stage restarts and replays
    def _recover(self, st: StageState, why: str) -> None:
        detected = time.time()
        st.failed_at = detected
        frontier = max(s.last_mb for s in self.stages)
        self.on_event("failure", {"stage": st.k, "device": st.device.name, "why": why, "frontier": frontier})
        st.client.close()
        self._rejoin(st, why, detected)
        self._push(st)
        if self.settings.recovery == "global-rollback":
            self._global_rollback(st, why, detected, frontier)
            return
        self._assign(st)  # resumes from its own checkpoint
        self._point_upstream_at(st)
        st.failed_at = None
        st.last_mb = (st.committed + 1) * self.settings.window_size - 1
        self.last_progress = time.time()
        self._record_recovery("local", [st], why, detected, frontier, resumed_after_window=st.committed)

    def _global_rollback(self, failed: StageState, why: str, detected: float, frontier: int) -> None:
        """The BP-pipeline baseline: every stage goes back to the last globally consistent
        checkpoint and the whole pipeline replays from there."""
        g = min(s.committed for s in self.stages)
        for st in reversed(self.stages):  # downstream first: each needs its neighbour's new data port
            self._assign(st, rollback_to=g)
            st.committed = g
            st.last_mb = (g + 1) * self.settings.window_size - 1
        self.feeder.set_address(self._address(None, self.stages[0]))
        failed.failed_at = None
        self._record_recovery("global-rollback", self.stages, why, detected, frontier, resumed_after_window=g)

    def _reconnect_live(self, st: StageState, until: float) -> bool:
        """A phone whose process still runs (its stage failed inside the app) is reconnected as it
        is, as a real phone is; False if it is gone or does not answer by `until`."""
        while st.device.alive is not None and st.device.alive() and time.time() < until:
            try:
                self._connect(st, timeout=max(1.0, until - time.time()))
                return True
            except (OSError, DeviceError):
                time.sleep(0.2)  # it may still be closing the old session
        return False

    def _rejoin(self, st: StageState, why: str, detected: float) -> None:
        deadline = detected + self.settings.rejoin_timeout
        if self._reconnect_live(st, detected + 3.0):
            return
        while True:
            try:
                if st.device.restart is not None:
                    st.device.endpoint = st.device.restart()
                self._connect(st)
                return
            except (OSError, DeviceError) as e:
                if time.time() > deadline:
                    raise RunError(f"stage {st.k} ({st.device.name}) did not come back within "
                                   f"{self.settings.rejoin_timeout:.0f} s after '{why}': restart the app on the phone "
                                   f"and resume with zl-host run --resume {self.run_dir}") from None
                self.on_event("waiting", {"stage": st.k, "device": st.device.name, "error": str(e)})
                time.sleep(1.0)

    def _point_upstream_at(self, st: StageState) -> None:
        """Only the upstream neighbour learns the restarted stage's address; nobody rolls back."""
        if st.k == 0:
            self.feeder.set_address(self._address(None, st))
        else:
            up = self.stages[st.k - 1]
            up.meta["downstream"] = self._address(up, st)
            if up.failed_at is not None or not up.client.alive:
                return  # it failed too: its own recovery assigns it, with this address
            try:
                up.client.assign({k: v for k, v in up.meta.items() if k != "request_id"})
            except DeviceError:
                if up.client.alive:
                    raise
                # it died while being rewired: its connection-lost event recovers it, with this address

    def _record_recovery(self, kind, stages, why, detected, frontier, resumed_after_window) -> None:
        rec = {"kind": kind, "stages": [s.k for s in stages], "why": why, "detected": detected,
               "rejoined": time.time(), "frontier": frontier, "resumed_after_window": resumed_after_window,
               "caught_up": None, "bytes_at_detection": self.link_bytes()}
        self.recoveries.append(rec)
        self.on_event("rejoined", {"stage": stages[0].k if len(stages) == 1 else "all", "kind": kind,
                                   "device": ",".join(s.device.name for s in stages),
                                   "resumed_after_window": resumed_after_window})

    def _check_caught_up(self) -> None:
        for rec in self.recoveries:
            if rec["caught_up"] is None and all(self.stages[k].last_mb >= rec["frontier"] for k in rec["stages"]):
                rec["caught_up"] = time.time()
                self.on_event("caught_up", {k: v for k, v in rec.items() if k != "stages"})

    def link_bytes(self) -> int:
        """Hidden-state bytes sent on every link so far (host feed included)."""
        return sum(s.bytes_banked + s.bytes_out for s in self.stages) + (self.feeder.bytes_sent if self.feeder else 0)

    # ---- the end
    def stop_sampling(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def finish(self) -> dict:
        self.stop_sampling()
        lora = {}
        for st in self.stages:
            reply = st.client.get_state("lora")
            lora.update({k: np.array(v) for k, v in reply.tensors.items()})
        for st in self.stages:
            st.client.shutdown()
        if self.feeder:
            self.feeder.close()
        self.metrics.close()
        return {"lora": lora, "recoveries": self.recoveries, "link_bytes": self.link_bytes(),
                "seconds": time.time() - self.started, "errors": self.errors}


from zl_common.hashing import sha256_file as _sha  # noqa: E402
