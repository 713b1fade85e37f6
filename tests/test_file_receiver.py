"""zl_mobile/file_receiver.py on its own: a transfer with no chunk for `stale_after` seconds is
abandoned (descriptor closed, part file removed) and its FILE_END says why."""
from __future__ import annotations

import hashlib

import numpy as np

from zl_mobile.file_receiver import FileReceiver, clear_incoming
from zl_mobile.protocol import Message, MsgType


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_stale_transfer_is_abandoned_and_its_end_says_why(tmp_path):
    files, incoming = tmp_path / "files", tmp_path / "incoming"
    files.mkdir()
    clear_incoming(incoming)
    clock = Clock()
    rx = FileReceiver(files, incoming, stale_after=60, clock=clock)
    data = b"x" * 100
    sha = hashlib.sha256(data).hexdigest()
    rx.begin(Message(MsgType.FILE_BEGIN, {"transfer_id": 1, "name": "slow.bin", "kind": "other", "size": 200,
                                          "sha256": sha}))
    rx.chunk(Message(MsgType.FILE_CHUNK, {"transfer_id": 1, "offset": 0}, {"data": np.frombuffer(data, np.uint8)}))
    clock.t = 59
    rx.sweep()
    assert rx.open_count == 1  # still within its time
    clock.t = 121
    rx.sweep()
    assert rx.open_count == 0 and list(incoming.iterdir()) == []
    reply = rx.end(Message(MsgType.FILE_END, {"transfer_id": 1}))
    assert reply["ok"] is False and "no chunk for 60 s" in reply["message"]
    assert list(files.iterdir()) == []


def test_leftover_part_files_of_a_killed_phone_are_removed_at_start(tmp_path):
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    (incoming / "7-abc.part").write_bytes(b"half")
    clear_incoming(incoming)
    assert incoming.is_dir() and list(incoming.iterdir()) == []


def test_a_refused_begin_drops_its_chunks_and_answers_its_end(tmp_path):
    # the host sends chunks right behind FILE_BEGIN: those of a refused one must not count as a
    # transfer never begun (an ERROR without request_id, which ends the session: PROTOCOL.md 5.1)
    files, incoming = tmp_path / "files", tmp_path / "incoming"
    files.mkdir()
    clear_incoming(incoming)
    rx = FileReceiver(files, incoming, max_open=1)
    begin = {"kind": "other", "size": 4, "sha256": "00" * 32}
    assert rx.begin(Message(MsgType.FILE_BEGIN, {"transfer_id": 1, "name": "a.bin", **begin})) is None
    first = rx.begin(Message(MsgType.FILE_BEGIN, {"transfer_id": 2, "name": "b.bin", **begin}))
    assert first["ok"] is False and "1 transfers are already open" in first["message"]
    assert rx.chunk(Message(MsgType.FILE_CHUNK, {"transfer_id": 2, "offset": 0},
                            {"data": np.frombuffer(b"abcd", np.uint8)})) is None
    end = rx.end(Message(MsgType.FILE_END, {"transfer_id": 2}))
    assert end["transfer_id"] == 2 and end["ok"] is False and "already open" in end["message"]
    assert rx.open_count == 1 and list(files.iterdir()) == []
