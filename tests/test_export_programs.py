"""The exported programs are right: program == eager, two-phase == one-method, no forward
recompute in phase 2, and a few optimizer steps follow the eager trajectory."""
import math
import re
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from exporter.chunk_model import example_inputs, input_names, lora_config, peft_name
from exporter.lower import joint_program, lower_joint
from exporter.manifest import load_manifest
from exporter.two_phase import split_at_marker
from exporter.verify import failures, sample_lora, verify_all, verify_chunk
from zl_common.manifest import MODES, ChunkEntry
from zl_common.program import ChunkProgram

from .conftest import matmul_flops


def _hf(artifacts):
    class C:
        vocab_size, hidden_size = artifacts[0].chunk.vocab_size, artifacts[0].chunk.norm.weight.shape[0]
    return C


def test_manifest_lists_files_methods_and_versions(small_export):
    out, manifest, artifacts, cfg = small_export
    m = load_manifest(out)  # checks every file's size and sha256
    assert [c["layers"] for c in m["chunks"]] == [[0, 0], [1, 1], [2, 2]]
    assert m["model"]["weights_sha256"] and len(m["model"]["weights_sha256"]) == 64
    assert set(m["versions"]) >= {"torch", "executorch", "zerolock"}
    assert m["export"]["alpha"] == cfg.alpha and m["export"]["seq_len"] == 16
    c0, c1, c2 = m["chunks"]
    assert c0["methods"]["phase1"]["inputs"][-3]["name"] == "input_ids"
    assert c1["methods"]["phase1"]["inputs"][-3] == {"name": "h_in", "shape": [2, 16, 64], "dtype": "float32"}
    assert c1["methods"]["phase1"]["outputs"][0] == {"name": "h_out", "shape": [2, 16, 64], "dtype": "float32"}
    p2_out = [o["name"] for o in c1["methods"]["phase2"]["outputs"]]
    assert p2_out[:3] == ["loss", "task_loss", "consis_loss"]
    assert p2_out[3:] == ["grad:" + t["name"] for t in c1["lora"]]
    paths = {f["path"] for f in m["files"]}
    assert {"chunk_0.pte", "chunk_0.ptd", "chunk_1.pte", "chunk_1.ptd", "tokenizer/tokenizer.json"} <= paths


def test_lora_names_match_peft_on_the_full_model(small_export, small_model_dir):
    out, manifest, artifacts, cfg = small_export
    full = get_peft_model(LlamaForCausalLM.from_pretrained(small_model_dir), lora_config(cfg))
    from peft import get_peft_model_state_dict
    peft_keys = {"base_model.model." + k.removeprefix("base_model.model.") for k in get_peft_model_state_dict(full)}
    ours = {t["name"] for c in manifest["chunks"] for t in c["lora"]}
    assert ours == peft_keys
    init = load_file(str(out / manifest["chunks"][1]["lora_init"]))
    assert set(init) == {t["name"] for t in manifest["chunks"][1]["lora"]}
    assert all(float(v.abs().sum()) == 0 for k, v in init.items() if "lora_B" in k)  # peft init: B = 0


def test_program_matches_eager(small_export):
    out, manifest, artifacts, cfg = small_export
    rows = verify_all(out, artifacts, cfg, _hf(artifacts), report=lambda s: None)
    assert len(rows) == 6  # ZeroLock and BP programs of three chunks
    for d in rows:
        assert failures(d) == [] and {"h_out"} <= set(d) and any(n.startswith("grad:") for n in d)
        assert d["h_out"]["err"] < 1e-5 and all(r["err"] <= r["tol"] for r in d.values())


def test_verify_catches_a_wrong_program(small_export, tmp_path):
    """Swap chunk 1's weights for chunk 0's: verification must notice."""
    out, manifest, artifacts, cfg = small_export
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shutil.copy(bad / "chunk_0.ptd", bad / "chunk_1.ptd")
    d = verify_chunk(bad, artifacts[1], cfg, _hf(artifacts))
    assert "h_out" in failures(d) and d["h_out"]["err"] > 100 * d["h_out"]["tol"]


def test_phase2_does_not_recompute_the_forward(small_export):
    out, manifest, artifacts, cfg = small_export
    art = artifacts[1]
    inputs = example_inputs(art.chunk, cfg, 512, 64)
    ep = joint_program(art.chunk, inputs)
    joint = matmul_flops(ep)
    split = split_at_marker(ep, input_names(False))
    f1, f2 = matmul_flops(split.phase1.program), matmul_flops(split.phase2.program)
    assert f1 > 0 and f2 > 0
    assert f1 + f2 == joint  # every matmul of the joint graph runs exactly once
    # phase 2 holds no forward-layer matmul: the forward's FLOPs all sit in phase 1
    fwd_only = matmul_flops(torch.export.export(art.chunk, inputs, strict=False).run_decompositions())
    # two readouts (p_k and p_{k-1}) and dL/dz @ lm_head, which readout_loss runs in the forward
    readout = 3 * 2 * cfg.readout_rows * 64 * 512
    assert f1 == fwd_only - readout


def test_two_phase_equals_one_method_program(small_export):
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer

    out, manifest, artifacts, cfg = small_export
    art = artifacts[1]
    entry = manifest["chunks"][1]
    inputs = example_inputs(art.chunk, cfg, 512, 64, seed=3)
    lora = sample_lora(entry, seed=5)
    to_local = {peft_name(n, art.first): n for n in art.chunk.lora_parameters()}
    params = art.chunk.lora_parameters()
    with torch.no_grad():
        for g, v in lora.items():
            params[to_local[g]].copy_(v)
    buffer = lower_joint(joint_program(art.chunk, inputs)).buffer  # must outlive the module
    one = _load_for_executorch_for_training_from_buffer(buffer)
    outs = one.forward_backward("forward", inputs)
    grads_one = one.named_gradients()

    prog = ChunkProgram(out, entry)
    batch = dict(zip(input_names(False), inputs))
    h, saved = prog.phase1(lora, batch)
    res = prog.phase2(lora, saved, batch)
    assert abs(res.loss - float(outs[0])) <= 1e-6
    assert torch.allclose(h, outs[3], atol=1e-6)
    for g, local in to_local.items():
        assert torch.allclose(res.grads[g], grads_one[local], atol=1e-7, rtol=1e-5), g


def test_phase2_reads_phase1_outputs_in_place(small_export):
    """Phase 2's inputs have no planned storage, so an in-place ChunkProgram hands it phase 1's
    outputs where phase 1 wrote them (no copy) with the same numbers; a phase 2 on outputs that
    a later phase 1 overwrote is refused."""
    from zl_common.program import ProgramError

    out, manifest, artifacts, cfg = small_export
    entry = manifest["chunks"][1]
    batch = dict(zip(input_names(False), example_inputs(artifacts[1].chunk, cfg, 512, 64, seed=4)))
    lora = sample_lora(entry, seed=6)
    copied, in_place = ChunkProgram(out, entry), ChunkProgram(out, entry, in_place=True)
    meta = in_place._module.method_meta("phase2")
    assert not any(meta.input_tensor_meta(i).is_memory_planned() for i in range(meta.num_inputs()))
    assert all(meta.output_tensor_meta(i).is_memory_planned() for i in range(meta.num_outputs()))

    h_c, saved_c = copied.phase1(lora, batch)
    res_c = copied.phase2(lora, saved_c, batch)
    h_i, saved_i = in_place.phase1(lora, batch)
    res_i = in_place.phase2(lora, saved_i, batch)
    assert res_i.loss == res_c.loss and torch.equal(h_i, h_c)
    assert all(torch.equal(res_i.grads[n], res_c.grads[n]) for n in res_c.grads)

    first = {n: t.data_ptr() for n, t in saved_i.items() if isinstance(t, torch.Tensor)}
    _, again = in_place.phase1(lora, batch)  # the same arena slots: nothing was copied out
    assert {n: t.data_ptr() for n, t in again.items() if isinstance(t, torch.Tensor)} == first
    _, saved_c2 = copied.phase1(lora, batch)
    assert saved_c2["h_out"].data_ptr() != saved_c["h_out"].data_ptr()
    with pytest.raises(ProgramError, match="overwritten in place"):
        in_place.phase2(lora, saved_i, batch)
    assert in_place.phase2(lora, again, batch).loss == res_c.loss


def test_phase1_outputs_are_planned_apart_from_its_working_memory(small_export):
    """Phase 1's outputs (h and the saved activations phase 2 reads) lie in a memory id of their
    own, its working tensors in id 1, and phase 2 plans only id 1: so a runtime that gives both
    phases one working arena (ExecuTorch's share_memory_arenas, the Kotlin bridge) keeps what
    phase 2 reads. Checked on the ZeroLock and the BP programs, against the outputs' sizes."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    from exporter.lower import PHASE1_OUTPUTS_MEM_ID

    out, manifest, _, _ = small_export
    sizes = {"float32": 4, "int64": 8, "int32": 4}
    for chunk in manifest["chunks"]:
        for entry in (chunk, chunk["bp"]):
            prog = deserialize_pte_binary((out / entry["program"]).read_bytes())
            plans = {p.name: list(p.non_const_buffer_sizes) for p in getattr(prog, "program", prog).execution_plan}
            outputs = sum(sizes[o["dtype"]] * math.prod(o["shape"]) for o in entry["methods"]["phase1"]["outputs"])
            p1, p2 = plans["phase1"], plans["phase2"]
            assert len(p1) == PHASE1_OUTPUTS_MEM_ID + 1 and p1[1] > 0, (entry["program"], p1)
            assert outputs <= p1[PHASE1_OUTPUTS_MEM_ID] < outputs + 64 * len(entry["methods"]["phase1"]["outputs"]), (p1, outputs)
            assert len(p2) == 2, (entry["program"], p2)
    # the Kotlin bridge looks for the outputs in that id (compiled in: it shares arenas only then)
    bridge = (Path(__file__).resolve().parents[1] / "kotlin_app/jni/zl_executorch.cpp").read_text()
    assert re.search(r"constexpr size_t kOutputsMemId = (\d+);", bridge).group(1) == str(PHASE1_OUTPUTS_MEM_ID)


def test_optimizer_steps_follow_the_eager_trajectory(small_export):
    out, manifest, artifacts, cfg = small_export
    art = artifacts[0]
    entry = manifest["chunks"][0]
    prog = ChunkProgram(out, entry)
    inputs = example_inputs(art.chunk, cfg, 512, 64, seed=11)
    batch = dict(zip(input_names(True), inputs))
    to_local = {peft_name(n, art.first): n for n in art.chunk.lora_parameters()}
    start = sample_lora(entry, seed=2)

    theirs = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    opt_prog = torch.optim.AdamW(list(theirs.values()), lr=1e-2)
    params = art.chunk.lora_parameters()
    with torch.no_grad():
        for g, v in start.items():
            params[to_local[g]].copy_(v)
    opt_eager = torch.optim.AdamW([params[to_local[g]] for g in start], lr=1e-2)
    losses_p, losses_e = [], []
    for _ in range(4):
        cur = {k: v.detach() for k, v in theirs.items()}
        h, saved = prog.phase1(cur, batch)
        res = prog.phase2(cur, saved, batch)
        for k, v in theirs.items():
            v.grad = res.grads[k]
        opt_prog.step()
        losses_p.append(res.loss)

        opt_eager.zero_grad()
        loss = art.chunk(*inputs)[0]
        loss.backward()
        opt_eager.step()
        losses_e.append(loss.item())
    assert losses_p[-1] < losses_p[0]  # it trains
    for a, b in zip(losses_p, losses_e):
        assert abs(a - b) < 1e-4
    for g in start:
        assert torch.allclose(theirs[g].detach(), params[to_local[g]].detach(), atol=1e-5)


def test_programs_carry_the_metadata_androids_training_module_reads(small_export):
    """TrainingModule.executeForwardBackward(m) returns outputs [0, gradients_index) and maps
    outputs [gradients_index, parameters_index) to the fqn names: run those metadata methods in
    ExecuTorch's runtime and check them against what the manifest says each output is."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    out, manifest, _, _ = small_export
    for chunk in manifest["chunks"]:
        lora = {t["name"] for t in chunk["lora"]}
        for entry in (chunk, chunk["bp"]):
            module = _load_for_executorch(str(out / entry["program"]), data_path=str(out / entry["weights"]))
            for method in ("phase1", "phase2"):
                names = [o["name"] for o in entry["methods"][method]["outputs"]]
                (grad_start,) = module.run_method(f"__et_training_gradients_index_{method}", ())
                (param_start,) = module.run_method(f"__et_training_parameters_index_{method}", ())
                fqn = list(module.run_method(f"__et_training_fqn_{method}", ()))
                assert param_start == len(names)  # no parameter outputs
                assert not any(n.startswith("grad:") for n in names[:grad_start])
                assert names[grad_start:] == [f"grad:{n}" for n in fqn]
                assert set(fqn) == (lora if method == "phase2" else set()), (entry["program"], method)


def test_the_android_training_module_route_runs_the_programs_as_the_phone_does(small_export):
    """Issue 30, item 5: on Android a .pte + .ptd loads only through TrainingModule, so ChunkProgram.kt
    runs each method as executeForwardBackward(m) (the outputs before the gradients) and takes the
    rest by name from namedGradients(m) ("grad:<name>" in the manifest, "<name>" in ExecuTorch).
    That route, through ExecuTorch's own TrainingModule (its binding reads the same metadata methods
    as the C++ class the Java one wraps), gives every output of phase 1 and phase 2, in the
    manifest's order, bit for bit as the phone's direct method calls do, and the step trains."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch
    from executorch.extension.training.pybindings._training_module import TrainingModule

    from zl_common.program import ChunkProgram as DirectProgram
    from zl_common.program import NamedMethods

    class AndroidRoute(NamedMethods):  # ChunkProgram.kt's run(), line for line
        def __init__(self, export_dir, chunk):
            super().__init__(chunk)
            module = _load_for_executorch(str(export_dir / chunk["program"]), data_path=str(export_dir / chunk["weights"]))
            self.training = TrainingModule(module)

        def run(self, method, values):
            output_names = [o["name"] for o in self.methods[method]["outputs"]]
            user = self.training.forward_backward(method, list(self._args(method, values)))
            if len(user) < len(output_names):
                grads = self.training.named_gradients()
                user = [*user, *(grads[n.removeprefix("grad:")] for n in output_names[len(user):])]
            assert len(user) == len(output_names), (method, len(user), output_names)
            return dict(zip(output_names, user))

    def fill(program, method, values, g):  # what a step gets from elsewhere (BP: a probe, the upstream's gradient)
        dtypes = {"float32": torch.float32, "int64": torch.long}
        return values | {i["name"]: torch.randn(i["shape"], generator=g).to(dtypes[i["dtype"]])
                         for i in program.input_spec(method) if i["name"] not in values}

    out, manifest, artifacts, cfg = small_export
    for chunk, art in zip(manifest["chunks"], artifacts):
        for entry in (ChunkEntry.from_json(chunk).for_mode(m).json for m in MODES):  # ZeroLock's programs and backprop's
            batch = dict(zip(input_names(art.chunk.is_first), example_inputs(art.chunk, cfg, 512, 64, seed=7)))
            android, direct = AndroidRoute(out, entry), DirectProgram(out, entry)
            values = fill(direct, "phase1", batch | sample_lora(entry, seed=8), torch.Generator().manual_seed(8))
            saved_a, saved_d = android.run("phase1", values), direct.run("phase1", values)
            assert list(saved_a) == list(saved_d)
            assert all(torch.equal(saved_a[n], saved_d[n]) for n in saved_d), entry["program"]
            values = fill(direct, "phase2", values | saved_d, torch.Generator().manual_seed(9))
            res_a, res_d = android.run("phase2", values), direct.run("phase2", values)
            assert list(res_a) == list(res_d) and {f"grad:{n}" for n in android.lora_names} <= res_a.keys()
            assert all(torch.equal(res_a[n], res_d[n]) for n in res_d), entry["program"]
            assert any(res_a[f"grad:{n}"].abs().sum() > 0 for n in android.lora_names)


def test_training_metadata_refuses_gradients_that_are_not_last():
    from exporter.training_metadata import training_constant_methods

    ok = training_constant_methods({"m": {"outputs": [{"name": "loss"}, {"name": "grad:a"}, {"name": "grad:b"}]}})
    assert ok == {"__et_training_gradients_index_m": 1, "__et_training_parameters_index_m": 3,
                  "__et_training_fqn_m": ["a", "b"]}
    with pytest.raises(ValueError, match="must come last"):
        training_constant_methods({"m": {"outputs": [{"name": "grad:a"}, {"name": "loss"}, {"name": "grad:b"}]}})


def test_running_a_chunk_leaves_the_compiler_unimported(small_export):
    """A phone process (its modules, a chunk loaded through the backend, one step) never imports
    ExecuTorch's compiler side or what it drags in (portable_lib would: 130 MiB of PSS)."""
    import subprocess
    import sys

    out, manifest, _, _ = small_export
    script = f"""
import json, sys
from pathlib import Path
import zl_mobile.phone, zl_mobile.stage, zl_mobile.device
from zl_mobile.backends import Backend
from exporter.chunk_model import example_inputs, input_names
from exporter.config import ExportConfig
from exporter.verify import sample_lora
out = Path({str(out)!r})
manifest = json.loads((out / "manifest.json").read_text())
entry, e, mc = manifest["chunks"][1], manifest["export"], manifest["model"]["config"]
backend = Backend.from_args("executorch")
backend.check_runtime()
backend.set_threads(1)
prog = backend.load(out, entry, in_place=True)
class C: is_first = False
cfg = ExportConfig(seq_len=e["seq_len"], micro_batch=e["micro_batch"], loss_positions=e["loss_positions"])
batch = dict(zip(input_names(False), example_inputs(C, cfg, mc["vocab_size"], mc["hidden_size"])))
lora = sample_lora(entry, 0)
h, saved = prog.phase1(lora, batch)
print(prog.phase2(lora, saved, batch).loss)
print(sorted(m for m in ("executorch.exir", "sympy", "networkx", "torchao", "transformers", "peft") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    loss, loaded = r.stdout.strip().splitlines()[-2:]
    assert float(loss) > 0
    assert loaded == "[]", f"a phone process imported {loaded}"
