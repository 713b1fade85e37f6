"""zl_mobile.adamw.AdamW against torch.optim.AdamW, and the stage's CheckpointStore: round trip,
crash in the middle of a commit, corruption detection, pruning."""
from __future__ import annotations

import json

import pytest
import torch

from zl_mobile.adamw import AdamW, AdamWConfig
from zl_mobile.checkpoint import POINTER, Checkpoint, CheckpointError, CheckpointStore

SHAPES = {"layers.0.q.lora_A": (4, 16), "layers.0.q.lora_B": (16, 4), "layers.0.v.lora_A": (4, 16),
          "bias": (7,)}
STEPS = 6


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.5) for n, s in SHAPES.items()}


def _grads(step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    # a mix of scales (and an all-zero gradient on one step) to exercise eps and the bias corrections
    return {n: (torch.zeros(s) if step == 2 and n == "bias" else torch.randn(s, generator=g) * 10 ** (i - 2))
            for i, (n, s) in enumerate(SHAPES.items())}


def _run_both(cfg: AdamWConfig, foreach: bool):
    ours_p = _params()
    ref_p = {n: torch.nn.Parameter(t.clone()) for n, t in _params().items()}
    ours = AdamW(ours_p, cfg)
    ref = torch.optim.AdamW(list(ref_p.values()), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=foreach)
    for step in range(STEPS):
        grads = _grads(step)
        ours.step(grads)
        for n, p in ref_p.items():
            p.grad = grads[n].clone()
        ref.step()
        yield step, ours, ours_p, ref, ref_p


@pytest.mark.parametrize("weight_decay", [0.0, 0.01, 0.1])
def test_adamw_matches_torch_single_tensor_exactly(weight_decay):
    cfg = AdamWConfig(lr=1e-2, weight_decay=weight_decay)
    for step, ours, ours_p, ref, ref_p in _run_both(cfg, foreach=False):
        assert ours.step_count == step + 1
        for n, p in ref_p.items():
            st = ref.state[p]
            assert torch.equal(ours_p[n], p.detach()), f"{n} differs after step {step + 1}"
            assert torch.equal(ours.exp_avg[n], st["exp_avg"]), f"exp_avg {n} differs after step {step + 1}"
            assert torch.equal(ours.exp_avg_sq[n], st["exp_avg_sq"]), f"exp_avg_sq {n} after step {step + 1}"
            assert int(st["step"]) == ours.step_count


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adamw_matches_torch_default_within_1e_7(weight_decay, foreach):
    cfg = AdamWConfig(lr=1e-2, weight_decay=weight_decay)
    moved = 0.0
    for step, ours, ours_p, ref, ref_p in _run_both(cfg, foreach=foreach):
        for n, p in ref_p.items():
            diff = float((ours_p[n] - p.detach()).abs().max())
            assert diff <= 1e-7, f"{n} differs by {diff:.3g} after step {step + 1}"
            moved = max(moved, float((ours_p[n] - _params()[n]).abs().max()))
    assert moved > 1e-2  # the comparison is not vacuous: the parameters did move


def test_adamw_state_round_trip_continues_identically():
    """What a checkpoint restores (state_tensors + step_count) continues exactly like the original."""
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.01)
    a_p = _params()
    a = AdamW(a_p, cfg)
    for step in range(3):
        a.step(_grads(step))
    b_p = {n: t.clone() for n, t in a_p.items()}
    b = AdamW(b_p, cfg)
    b.load_state_tensors({k: v.clone() for k, v in a.state_tensors().items()}, a.step_count)
    assert set(a.state_tensors()) == {f"{k}/{n}" for k in ("exp_avg", "exp_avg_sq") for n in SHAPES}
    for step in range(3, STEPS):
        a.step(_grads(step))
        b.step(_grads(step))
    for n in SHAPES:
        assert torch.equal(a_p[n], b_p[n])


def test_adamw_step_without_all_gradients_is_refused():
    opt = AdamW(_params())
    grads = _grads(0)
    del grads["bias"]
    with pytest.raises(ValueError, match="bias"):
        opt.step(grads)
    assert opt.step_count == 0


# ---- CheckpointStore ---------------------------------------------------------------------------

def _ckpt(window: int) -> Checkpoint:
    g = torch.Generator().manual_seed(window)
    lora = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    opt = {f"exp_avg/{n}": torch.randn(s, generator=g) for n, s in SHAPES.items()}
    opt.update({f"exp_avg_sq/{n}": torch.rand(s, generator=g) for n, s in SHAPES.items()})
    return Checkpoint(window=window, step=window + 1, lora=lora, optimizer=opt,
                      meta={"next_micro_batch": (window + 1) * 4, "note": f"window {window}"})


def _assert_same(got: Checkpoint, want: Checkpoint):
    assert (got.window, got.step, got.meta) == (want.window, want.step, want.meta)
    assert got.lora.keys() == want.lora.keys() and got.optimizer.keys() == want.optimizer.keys()
    for k in want.lora:
        assert torch.equal(got.lora[k], want.lora[k])
    for k in want.optimizer:
        assert torch.equal(got.optimizer[k], want.optimizer[k])


def test_checkpoint_round_trip(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    assert store.load() is None and store.pointer() is None
    want = _ckpt(0)
    sha = store.commit(want)
    ptr = store.pointer()
    assert ptr == {"window": 0, "step": 1, "file": "ckpt-00000000.safetensors", "sha256": sha}
    _assert_same(store.load(), want)
    _assert_same(CheckpointStore(tmp_path / "ck").load(), want)  # a new process sees the same
    assert not list((tmp_path / "ck").glob("*.tmp"))


class Crash(Exception):
    pass


@pytest.mark.parametrize("truncate_tmp", [False, True], ids=["tmp-left-whole", "tmp-left-truncated"])
def test_crash_mid_checkpoint_keeps_the_previous_commit(tmp_path, truncate_tmp):
    d = tmp_path / "ck"
    store = CheckpointStore(d)
    first = _ckpt(0)
    store.commit(first)

    def fail(point):
        if point == "mid-checkpoint":
            if truncate_tmp:  # as a crash during the write would leave it (what stage.py injects)
                tmp = next(d.glob("*.tmp"))
                with open(tmp, "r+b") as f:
                    f.truncate(tmp.stat().st_size // 2)
            raise Crash(point)

    store.fail_hook = fail
    with pytest.raises(Crash):
        store.commit(_ckpt(1))
    assert (d / "ckpt-00000001.safetensors.tmp").exists()  # the half-written file is left behind...
    assert not (d / "ckpt-00000001.safetensors").exists()
    # ...and ignored: the previous commit is loadable and in force, in this process and after a restart
    for s in (store, CheckpointStore(d)):
        assert s.pointer()["window"] == 0
        _assert_same(s.load(), first)
    # redoing the window commits it and clears the leftover
    restarted = CheckpointStore(d)
    second = _ckpt(1)
    restarted.commit(second)
    _assert_same(restarted.load(), second)
    assert not list(d.glob("*.tmp"))


def test_crash_after_rename_before_pointer_keeps_the_previous_commit(tmp_path):
    """A checkpoint file that COMMITTED does not name (crash between the rename and the pointer
    update) is not in force."""
    d = tmp_path / "ck"
    store = CheckpointStore(d)
    first = _ckpt(0)
    store.commit(first)
    other = CheckpointStore(tmp_path / "other")
    other.commit(_ckpt(1))
    (d / "ckpt-00000001.safetensors").write_bytes((tmp_path / "other" / "ckpt-00000001.safetensors").read_bytes())
    (d / (POINTER + ".tmp")).write_text('{"window": 1, "st')  # a half-written pointer, never renamed
    _assert_same(CheckpointStore(d).load(), first)


def test_corrupted_committed_checkpoint_is_detected(tmp_path):
    d = tmp_path / "ck"
    store = CheckpointStore(d)
    store.commit(_ckpt(0))
    path = d / store.pointer()["file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the tensor data: still a loadable safetensors file
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256") as ei:
        store.load()
    assert str(path) in str(ei.value) and "\n" not in str(ei.value)
    path.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        store.load()
    (d / POINTER).write_text('{"window": 0, "fi')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        store.load()


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_old_checkpoints_are_pruned(tmp_path, keep):
    d = tmp_path / "ck"
    store = CheckpointStore(d, keep=keep)
    for w in range(5):
        store.commit(_ckpt(w))
    names = sorted(p.name for p in d.glob("ckpt-*"))
    assert names == [f"ckpt-{w:08d}.safetensors" for w in range(5 - keep, 5)]
    assert json.loads((d / POINTER).read_text())["window"] == 4
    _assert_same(store.load(), _ckpt(4))
