"""The eager PyTorch backend (zl-phone --backend eager): the same chunk, interface, protocol and
schedules as the ExecuTorch programs, from the export's chunk_k_weights.safetensors, without
importing ExecuTorch. Compared with the ExecuTorch programs of the same export."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from exporter.manifest import load_manifest
from exporter.verify import bp_zero_probe, sample_lora
from host.run.settings import RunSettings
from tests.conftest import run_pipeline, small_micro_batches
from tests.test_export_bp import _batch
from zl_common.manifest import ChunkEntry
from zl_common.program import ChunkProgram, ProgramError
from zl_mobile.backends import EAGER_CAPABILITY, Backend
from zl_mobile.eager_program import GRAPH, EagerChunkProgram

TOL = 1e-5  # relative; fp32, the same ops in the same order (measured: ~1e-6)

# Makes `import executorch` (and its submodules) raise ImportError in a process started with this
# directory first on PYTHONPATH, and writes each attempt to $ZL_EXECUTORCH_LOG.
SHIM = '''
import os, sys, traceback
class _NoExecuTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "executorch" or name.startswith("executorch."):
            log = os.environ.get("ZL_EXECUTORCH_LOG")
            if log:
                with open(log, "a") as f:
                    f.write(name + "\\n" + "".join(traceback.format_stack(limit=12)) + "\\n")
            raise ImportError(f"executorch is not importable in this test ({name})")
        return None
sys.meta_path.insert(0, _NoExecuTorch())
'''


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _zl_batch(cfg, x_name, x):
    b = _batch(cfg, 512, seed=4)
    b["alpha"] = torch.tensor([cfg.alpha])
    b[x_name] = x
    return b


def test_manifest_lists_the_eager_weights(small_export, small_model_dir):
    from safetensors.torch import load_file

    out, manifest, _, _ = small_export
    source = load_file(str(small_model_dir / "model.safetensors"))
    m = load_manifest(out)  # every listed file exists with its sha256
    paths = {f["path"] for f in m["files"]}
    assert m["model"]["hf_config"]["num_hidden_layers"] == 3
    for c in m["chunks"]:
        k = c["index"]
        assert c["eager_weights"] == f"chunk_{k}_weights.safetensors" and c["eager_weights"] in paths
        with safe_open(str(out / c["eager_weights"]), "pt") as f:
            keys = set(f.keys())
            assert f.metadata()["format"] == "zerolock-eager-weights"
        layers = {n.split(".")[2] for n in keys if n.startswith("model.layers.")}
        assert layers == {str(k)}  # this chunk's layer only, under the full model's numbering
        assert {"model.norm.weight", "lm_head.weight"} <= keys  # the local loss's readout
        assert ("model.embed_tokens.weight" in keys) == (k == 0)
        assert not any("lora_" in n or "base_layer" in n for n in keys)
        mine = load_file(str(out / c["eager_weights"]))
        assert all(torch.equal(t, source[n]) for n, t in mine.items())  # the model's own weights, bit for bit


@pytest.fixture(params=["small_export", "small_export_int8", "small_export_int4"])
def fp32_or_int8_export(request):
    """The small export with fp32 base weights (portable kernels) and with int8 / int4 ones (XNNPACK)."""
    return request.getfixturevalue(request.param)


def test_eager_program_equals_executorch_zerolock(fp32_or_int8_export):
    out, manifest, _, cfg = fp32_or_int8_export
    h = None
    for c in manifest["chunks"]:
        x_prog, e_prog = ChunkProgram(out, c), EagerChunkProgram(out, c)
        lora = sample_lora(c, seed=c["index"])  # lora_B nonzero: every gradient is exercised
        b = _zl_batch(cfg, c["first_input"], _batch(cfg, 512, seed=4)["input_ids"] if h is None else h)
        h_x, saved_x = x_prog.phase1(lora, b)
        h_e, saved_e = e_prog.phase1(lora, b)
        assert h_e.dtype == h_x.dtype and h_e.shape == h_x.shape
        assert _rel(h_e, h_x) <= TOL, c["index"]
        r_x, r_e = x_prog.phase2(lora, saved_x, b), e_prog.phase2(lora, saved_e, b)
        for key in ("loss", "task_loss", "consis_loss"):
            # consis (a KL of two close distributions, ~4e-3) differs by ~1e-7 in absolute terms
            assert getattr(r_e, key) == pytest.approx(getattr(r_x, key), rel=TOL, abs=TOL), (c["index"], key)
        assert set(r_e.grads) == set(r_x.grads) == {t["name"] for t in c["lora"]}
        for n, g in r_x.grads.items():
            assert g.abs().max() > 0, n
            assert _rel(r_e.grads[n], g) <= TOL, (n, _rel(r_e.grads[n], g))
        h = h_x


def test_eager_program_equals_executorch_bp(fp32_or_int8_export):
    """The BP stages as a pipeline: forwards, then backwards passing grad_h_in upstream."""
    out, manifest, _, cfg = fp32_or_int8_export
    entries = [ChunkEntry.from_json(c).for_mode("bp").json for c in manifest["chunks"]]
    b = _batch(cfg, 512, seed=4)
    loras = [sample_lora(e, seed=10 + k) for k, e in enumerate(entries)]
    results = {}
    for backend, cls in (("executorch", ChunkProgram), ("eager", EagerChunkProgram)):
        progs = [cls(out, e) for e in entries]
        fwd, h = [], None
        for k, (p, e) in enumerate(zip(progs, entries)):
            first = {"input_ids": b["input_ids"]} if k == 0 else {"h_in": h, **bp_zero_probe(e)}
            fwd.append(p.run("phase1", {**b, **first, **loras[k]}))
            h = fwd[-1]["h_out"]
        outs, g_up = {}, None
        for k in reversed(range(3)):
            extra = {} if k == 2 else {"grad_h_out": g_up}
            r = progs[k].run("phase2", {**b, **fwd[k], **loras[k], **extra})
            want = [o["name"] for o in entries[k]["methods"]["phase2"]["outputs"]]
            assert sorted(r) == sorted(want), (backend, k)  # the same outputs, by the manifest's names
            g_up = r.get("grad_h_in")
            outs.update({f"{k}/{n}": v for n, v in r.items()})
            outs[f"{k}/h_out"] = fwd[k]["h_out"]
        results[backend] = outs
    ref = results["executorch"]
    assert set(results["eager"]) == set(ref)
    for n, v in ref.items():
        assert _rel(results["eager"][n], v) <= TOL, (n, _rel(results["eager"][n], v))


def test_eager_phase2_runs_no_layer_forward(small_export):
    """Phase 2 back-propagates through phase 1's graph: no decoder layer runs again."""
    out, manifest, _, cfg = small_export
    for mode in ("zerolock", "bp"):
        c = ChunkEntry.from_json(manifest["chunks"][1]).for_mode(mode).json
        p = EagerChunkProgram(out, c)
        calls = []
        for layer in p.module.layers:
            layer.register_forward_hook(lambda *a: calls.append(1))
        b = _zl_batch(cfg, "h_in", torch.randn(2, 16, 64))
        lora = sample_lora(c, seed=1)
        saved = p.run("phase1", {**b, **lora, **bp_zero_probe(c)})
        assert len(calls) == 1 and GRAPH in saved
        p.run("phase2", {**b, **saved, **lora, "grad_h_out": torch.randn(2, 16, 64)})
        assert len(calls) == 1, mode


def _without_eager_weights(src: Path, dest: Path) -> Path:
    """A copy of an export as one made without --eager-weights."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("chunk_*_weights.safetensors"))
    m = json.loads((dest / "manifest.json").read_text())
    for c in m["chunks"]:
        c.pop("eager_weights")
    m["files"] = [f for f in m["files"] if not f["path"].endswith("_weights.safetensors")]
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


def test_export_without_eager_weights_is_one_line_error(small_export, tmp_path):
    from zl_mobile.device import Device
    from zl_mobile.protocol import Message, MsgType, ProtocolError, new_token

    out, manifest, _, _ = small_export
    old = _without_eager_weights(out, tmp_path / "old")
    chunk = json.loads((old / "manifest.json").read_text())["chunks"][1]
    with pytest.raises(ProgramError) as e:
        EagerChunkProgram(old, chunk)
    msg = str(e.value)
    assert "\n" not in msg and "re-export with zl-export --eager-weights" in msg
    # a phone with the eager backend refuses the stage with that line (what the host shows)
    device = Device("eager-old", tmp_path / "phone", new_token(), backend=Backend.from_args("eager"))
    shutil.copy(old / "manifest.json", device.files / "manifest.json")
    meta = {"request_id": 7, "run_id": "r", "stage": 1, "num_stages": 3, "upstream_token": new_token(),
            "program_sha256": next(f["sha256"] for f in manifest["files"] if f["path"] == chunk["program"])}
    with pytest.raises(ProtocolError) as e:
        device.handle(Message(MsgType.STAGE_ASSIGN, meta))
    assert e.value.code.value == "REJECTED"
    assert "\n" not in e.value.message and "re-export with zl-export --eager-weights" in e.value.message
    assert device.stage is None


def _phone(args, tmp_path, env=None):
    cmd = [sys.executable, "-m", "zl_mobile.phone", "--name", "bad", "--workdir", str(tmp_path / "w"),
           "--mdns", "none", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("args,fix", [
    (["--backend", "eager", "--torch-device", "cuda"], "use --torch-device cpu"),
    (["--backend", "eager", "--torch-device", "gpu"], "use cpu, cuda or cuda:N"),
    (["--torch-device", "cpu"], "add --backend eager"),
])
def test_phone_bad_backend_options(tmp_path, args, fix):
    # the phone sees no CUDA device, also on a machine that has one: asking for cuda is then an error
    r = _phone(args, tmp_path, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 2, r
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("zl-phone: error: --torch-device") and fix in err, r.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def no_executorch(tmp_path_factory):
    """(env, log): an environment in which `import executorch` raises ImportError."""
    d = tmp_path_factory.mktemp("no_executorch")
    (d / "sitecustomize.py").write_text(SHIM)
    log = d / "attempts.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               ZL_EXECUTORCH_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", "import executorch"], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "ImportError: executorch is not importable in this test" in r.stderr, r.stderr
    log.unlink()
    return env, log


def test_executorch_backend_without_executorch_names_the_fix(tmp_path, no_executorch):
    env, log = no_executorch
    r = _phone([], tmp_path, env=env)
    assert r.returncode == 2, r
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("zl-phone: error: ExecuTorch cannot be imported here") and "--backend eager" in err
    log.unlink(missing_ok=True)  # that attempt was the point; the pipeline test expects none


def _run(out, root, backend_args, monkeypatch=None, env=None):
    hellos, pushed = {}, []

    def on_event(kind, data):
        if kind == "connected":
            hellos[data["stage"]] = data["hello"]
        elif kind == "push":
            pushed.append(data["file"])

    if env is not None:
        for k in ("PYTHONPATH", "ZL_EXECUTORCH_LOG"):
            monkeypatch.setenv(k, env[k])
    settings = RunSettings(windows=3, window_size=2, lr=2e-2, inflight_depth=4)
    mbs = small_micro_batches(out, n_examples=4)
    result, records = run_pipeline(out, root, settings, mbs, on_event=on_event, phone_args=backend_args)
    if env is not None:
        monkeypatch.undo()
    assert not result["errors"], result["errors"]
    losses = {(r["stage"], r["micro_batch"]): r["loss"] for r in records
              if r["type"] == "TELEMETRY" and r.get("kind", "micro_batch") == "micro_batch"}
    return result, losses, hellos, pushed


def test_pipeline_on_eager_phones_without_executorch(small_export, tmp_path, monkeypatch, no_executorch):
    """Three eager-backend phones (real processes in which ExecuTorch cannot be imported) train as
    far as three ExecuTorch phones on the same export and data: the same losses and LoRA."""
    out, manifest, _, _ = small_export
    env, log = no_executorch
    ref, ref_losses, ref_hellos, ref_pushed = _run(out, tmp_path / "et", [])
    res, losses, hellos, pushed = _run(out, tmp_path / "eager", ["--backend", "eager"], monkeypatch, env)
    assert not log.exists(), f"an eager phone tried to import ExecuTorch:\n{log.read_text()}"

    assert all("(executorch)" in h["runtime_version"] and "executorch" in h["capabilities"] for h in ref_hellos.values())
    assert all("(eager-cpu)" in h["runtime_version"] and EAGER_CAPABILITY in h["capabilities"] for h in hellos.values())
    assert {f"chunk_{k}_weights.safetensors" for k in range(3)} <= set(pushed)
    assert not any(p.endswith((".pte", ".ptd")) for p in pushed)  # an eager phone gets no ExecuTorch files
    assert not any(p.endswith("_weights.safetensors") for p in ref_pushed)

    assert set(losses) == set(ref_losses) and len(losses) == 3 * 6
    for key, v in ref_losses.items():
        assert losses[key] == pytest.approx(v, rel=1e-4), key
    # Adam scales every gradient to about lr per step, so fp32 differences of ~1e-6 in the gradients
    # show up as ~1e-5 in the LoRA after 3 steps (measured: 9e-6, lora_B of layer 2); the bound is
    # 0.5% of one step, against the ~3 steps (0.06) lora_B moved
    lr = 2e-2
    assert set(res["lora"]) == set(ref["lora"])
    diffs = {n: float(np.abs(res["lora"][n] - v).max()) for n, v in ref["lora"].items()}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= lr / 200, (worst, diffs[worst])
    assert max(float(np.abs(v).max()) for n, v in ref["lora"].items() if "lora_B" in n) > lr
