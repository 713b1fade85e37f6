"""The downstream of a calibration stage: the host takes the part of a next stage.

A calibration stage is a one-stage pipeline, so on its own it would never send a hidden state. In
a run every stage but the last does, per micro-batch: the frame encoded, handed to the link
thread, written to the replay store, credits and commits read back. On a phone held to 0.3 of a
core that work (3-4 ms of CPU a micro-batch) was 12 ms of a 50 ms stage, missing from every
profile. The sink receives the stage's hidden states through the same link code a stage uses
(zl_mobile.links.InboundLink: handshake, replay request, credits), drops them, and commits each
window as a downstream stage would, so the calibration stage pays what a sending stage pays."""
from __future__ import annotations

import secrets
import threading

from zl_mobile.link_rules import InboundQueue
from zl_mobile.links import InboundLink


class CalibrationSink:
    def __init__(self, window_size: int, inflight_depth: int):
        self.token = secrets.token_hex(32)
        self.window_size = window_size
        self.received = 0
        self._queue = InboundQueue()
        self._stop = threading.Event()
        self.link = InboundLink("calibration-sink", self.token, self._queue, inflight_depth=inflight_depth,
                                next_needed=lambda: self.received)
        self._thread = threading.Thread(target=self._drain, name="calibration-sink", daemon=True)
        self._thread.start()

    def address(self, client) -> str:
        """host:port of the sink as the phone behind `client` (a DeviceClient) reaches the host."""
        return f"{client.conn.sock.getsockname()[0]}:{self.link.port}"

    def _drain(self) -> None:
        while not self._stop.is_set():
            msg = self._queue.take(self.received, timeout=0.2)
            if msg is None:
                continue
            self.received += 1
            self.link.grant(1)
            if self.received % self.window_size == 0:  # a downstream commits each window it used
                w = self.received // self.window_size - 1
                self.link.committed(w, w + 1, "0" * 64)  # nothing is stored: no checkpoint hash

    def close(self) -> None:
        self._stop.set()
        self._queue.stop()
        self.link.close()
        self._thread.join(timeout=2.0)
