"""The replay buffer's on-disk copy (zl_mobile/replay_store.py) and a restarted upstream link that
serves from it over real loopback TCP: what was sent and not committed downstream outlives the
process; what cannot be served is an error naming it."""
import numpy as np

from tests.test_links_tcp import FakeDownstream, _hidden, _wait
from zl_mobile.link_rules import NO_END, replay_unavailable_message
from zl_mobile.links import OutboundLink
from zl_mobile.protocol import Message, MsgType, new_token
from zl_mobile.replay_store import ReplayStore

W = 2


def _wait_for(cond):
    _wait("the link to catch up", cond)


def _store(tmp_path, mbs) -> ReplayStore:
    store = ReplayStore(tmp_path / "replay")
    for mb in mbs:
        store.put(_hidden(mb, W))
    store.sync()
    return store


def test_load_keeps_the_unbroken_run_below_the_resume_point(tmp_path):
    store = _store(tmp_path, range(8))
    (store.dir / "mb-000000000009.tmp").write_bytes(b"half a write")
    got = store.load(below=6)
    assert [m["micro_batch"] for m in got] == [0, 1, 2, 3, 4, 5]
    assert np.asarray(got[3].tensors["h"]).ravel()[0] == 3  # the frame itself came back
    assert store.ids() == [0, 1, 2, 3, 4, 5]  # 6, 7: an uncommitted window, computed again; the .tmp is gone
    assert not list(store.dir.glob("*.tmp"))
    store.dir.joinpath("mb-000000000002.zlf").unlink()
    assert [m["micro_batch"] for m in store.load(below=6)] == [3, 4, 5]  # cut off by the gap
    store.dir.joinpath("mb-000000000004.zlf").write_bytes(b"damaged")
    assert [m["micro_batch"] for m in store.load(below=6)] == [5]
    store.drop_below(6)
    assert store.ids() == []


def test_a_restarted_upstream_serves_what_it_had_sent_from_disk(tmp_path):
    token = new_token()
    store = _store(tmp_path, range(2, 8))  # the downstream committed window 0; 6, 7 were never committed here
    down = FakeDownstream(token)
    errors = []
    link = OutboundLink("stage0-out", token, window_size=W, replay_horizon=6, store=ReplayStore(store.dir),
                        first_mb=6, on_error=errors.append)
    try:
        assert link.buffered() == [2, 3, 4, 5] and link.held() == 4
        link.set_address(down.address)
        down.connect()
        down.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": 2, "to_micro_batch": NO_END}))
        # the downstream re-announces its last commit (window 0: nothing to drop), then grants credits
        down.send(Message(MsgType.CHECKPOINT_COMMITTED, {"window": 0, "step": 1, "sha256": "0" * 64}))
        down.send(Message(MsgType.CREDIT, {"credits": 3}))
        assert down.read_sent(3) == [2, 3, 4]
        down.send(Message(MsgType.CHECKPOINT_COMMITTED, {"window": 1, "step": 2, "sha256": "0" * 64}))
        _wait_for(lambda: link.buffered() == [4, 5])
        assert store.ids() == [4, 5]  # dropped from memory and disk
        link.publish(_hidden(6, W))
        link.persist(6)
        assert down.read_sent(0) == [] and store.ids() == [4, 5, 6]
        down.send(Message(MsgType.CREDIT, {"credits": 2}))
        assert down.read_sent(2) == [5, 6]
        # a downstream that asks below what it had reported committed is answered with an error
        down.disconnect()
        down.connect()
        down.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": 2, "to_micro_batch": NO_END}))
        _wait_for(lambda: errors)
        assert errors == [replay_unavailable_message(2, 3, "stage0-out", 4)]
    finally:
        link.close()
        down.close()


def test_the_host_feed_builds_every_input_on_send_and_holds_none(tmp_path):
    token = new_token()
    down = FakeDownstream(token)
    built = []

    def source(mb):
        built.append(mb)
        return _hidden(mb, W)

    link = OutboundLink("host-feed", token, window_size=W, replay_horizon=4, source=source, source_total=5)
    try:
        link.set_address(down.address)
        down.connect()
        down.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": 0, "to_micro_batch": NO_END}))
        down.send(Message(MsgType.CREDIT, {"credits": 3}))
        assert down.read_sent(3) == [0, 1, 2] and built == [0, 1, 2] and link.held() == 0
        down.disconnect()
        down.connect()  # a restarted stage 0 asks again from its resume point: served, never an error
        down.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": 0, "to_micro_batch": NO_END}))
        down.send(Message(MsgType.CREDIT, {"credits": 9}))
        assert down.read_sent(5) == [0, 1, 2, 3, 4]  # and not past the run's last input
        down.quiet()
    finally:
        link.close()
        down.close()
