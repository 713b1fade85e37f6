"""zl-host and zl-export on careless input (issue 21): each gets one line naming the problem and
the fix and a non-zero exit, never a traceback; a mismatched adapter is refused, not evaluated
as if it were the base model; mostly-bad data is refused and partly-bad data said; an export
that was killed leaves no hidden folder behind once the next one runs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from exporter.cli import main as export_main
from host.cli.zl_host import main as host_main
from host.outputs.adapter import write_peft_adapter


def _line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ---- zl-host run --devices emulated:N ---------------------------------------------------------

@pytest.mark.parametrize("spec", ["emulated:abc", "emulated:", "emulated:3.5", "emulated:0", "emulated:-2"])
def test_emulated_needs_a_whole_number_of_phones(tmp_path, capsys, spec):
    assert host_main(["run", "--program", str(tmp_path), "--devices", spec]) == 2
    line = _line(capsys, "zl-host")
    assert repr(spec) in line and "whole number of phones" in line and "emulated:3" in line
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


# ---- zl-host eval ------------------------------------------------------------------------------

@pytest.fixture
def adapter(small_export, tmp_path):
    """A well-formed adapter for the small export (its LoRA initialisation, B = 0), as a run writes one."""
    out, manifest = small_export[0], small_export[1]
    lora = {}
    for c in manifest["chunks"]:
        lora.update(load_file(str(out / c["lora_init"])))
    base = str(Path(manifest["model"]["path"]))
    return write_peft_adapter(lora, manifest, tmp_path / "adapter", base), lora, manifest


def _eval(program, adapter_dir) -> int:
    return host_main(["eval", "--program", str(program), "--adapter", str(adapter_dir)])


def _edit_config(adapter_dir: Path, **over) -> None:
    path = adapter_dir / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(over)
    path.write_text(json.dumps(cfg))


def test_a_sound_adapter_passes_the_checks(small_export, adapter):
    from host.outputs.adapter_check import check_adapter

    adapter_dir, _, manifest = adapter
    check_adapter(adapter_dir, Path(manifest["model"]["path"]), manifest["lora"])


def test_eval_refuses_an_adapter_whose_rank_differs_from_its_config(small_export, adapter, capsys):
    adapter_dir = adapter[0]
    _edit_config(adapter_dir, r=8)  # the tensors are rank 4
    assert _eval(small_export[0], adapter_dir) == 2
    line = _line(capsys, "zl-host")
    assert "rank 4, but adapter_config.json says r=8" in line and "do not belong together" in line


def test_eval_refuses_a_corrupt_adapter(small_export, adapter, capsys):
    f = adapter[0] / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert _eval(small_export[0], adapter[0]) == 2
    line = _line(capsys, "zl-host")
    assert "adapter_model.safetensors is not a readable safetensors file" in line and "copy it again" in line


def test_eval_refuses_an_adapter_whose_config_targets_other_modules(small_export, adapter, capsys):
    """What peft would load with only a warning, then evaluate as the base model."""
    _edit_config(adapter[0], target_modules=["k_proj"])
    assert _eval(small_export[0], adapter[0]) == 2
    line = _line(capsys, "zl-host")
    assert "has LoRA for q_proj but its adapter_config.json targets k_proj" in line


def test_eval_refuses_a_sound_adapter_for_other_target_modules_than_the_program(small_export, adapter, tmp_path,
                                                                               capsys):
    import torch
    from safetensors.torch import save_file

    _, lora, manifest = adapter
    moved = {k.replace("v_proj", "k_proj"): torch.from_numpy(v) for k, v in lora.items()}  # k_proj and v_proj: same shapes
    other = tmp_path / "other"
    shutil.copytree(adapter[0], other)
    save_file(moved, str(other / "adapter_model.safetensors"))
    _edit_config(other, target_modules=["q_proj", "k_proj"])
    assert _eval(small_export[0], other) == 2
    line = _line(capsys, "zl-host")
    assert "adapter for k_proj, q_proj, but this program was exported with rank 4 for q_proj, v_proj" in line
    assert "--program it was trained on" in line


def test_eval_with_the_base_weights_missing_says_so_and_asks_no_hub(small_export, adapter, tmp_path, capsys):
    out, manifest = small_export[0], small_export[1]
    base = tmp_path / "base"
    shutil.copytree(manifest["model"]["path"], base)
    for f in base.glob("*.safetensors"):
        f.unlink()
    program = tmp_path / "program"
    shutil.copytree(out, program)
    m = json.loads((program / "manifest.json").read_text())
    m["model"]["path"] = str(base)
    (program / "manifest.json").write_text(json.dumps(m))
    assert _eval(program, adapter[0]) == 2
    line = _line(capsys, "zl-host")
    assert f"the base model dir {base} has no weights file" in line and "no model hub" in line


# ---- data with bad rows ------------------------------------------------------------------------

def test_a_jsonl_file_with_most_rows_bad_is_refused_with_the_rows_shown(small_export, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "news: ", "completion": "sports"}\n{"prompt": 3, "completion": "x"}\n'
                    'not json\n{"question": "?"}\n')
    assert host_main(["run", "--program", str(small_export[0]), "--data", str(data), "--devices", "emulated:3",
                      "--out", str(tmp_path / "r")]) == 2
    line = _line(capsys, "zl-host")
    assert "3 of 4 rows rejected" in line and "first at lines 2, 3, 4" in line and "not valid JSON" in line
    assert "refusing to train on the 1 usable row" in line
    assert not (tmp_path / "r").exists()


def test_a_jsonl_file_with_a_few_bad_rows_is_warned_about(small_export, tmp_path, capsys):
    from exporter.manifest import load_manifest
    from host.run.data import prepare_data
    from zl_common.data import synthetic_examples

    data = tmp_path / "rows.jsonl"
    rows = [json.dumps(e) for e in synthetic_examples(9, seed=1)]
    rows.insert(4, '{"text": ""}')
    data.write_text("\n".join(rows) + "\n")
    mbs = prepare_data(small_export[0], load_manifest(small_export[0], check_files=False), str(data))
    assert mbs
    err = capsys.readouterr().err
    assert "zl-host: warning:" in err and "1 of 10 rows rejected (1 rows with empty text; first at line 5)" in err


# ---- zl-export ---------------------------------------------------------------------------------

def _model_copy(small_model_dir, tmp_path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(small_model_dir, model)
    return model


def test_export_of_a_corrupt_safetensors_file(small_model_dir, tmp_path, capsys):
    model = _model_copy(small_model_dir, tmp_path)
    f = next(model.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:1000])
    assert export_main(["--model", str(model), "--out", str(tmp_path / "o")]) == 2
    line = _line(capsys, "zl-export")
    assert f"{f.name} is not a readable safetensors file" in line and "fetch the model files again" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("key,value,words", [
    ("hidden_size", "abc", "hidden_size is 'abc', must be a positive integer"),
    ("num_hidden_layers", -1, "num_hidden_layers is -1"),
    ("num_key_value_heads", 3, "num_key_value_heads is 3, must be a positive integer dividing"),
    ("rms_norm_eps", "tiny", "rms_norm_eps is 'tiny'"),
])
def test_export_of_a_bad_config_value(small_model_dir, tmp_path, capsys, key, value, words):
    model = _model_copy(small_model_dir, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))
    assert export_main(["--model", str(model), "--out", str(tmp_path / "o")]) == 2
    line = _line(capsys, "zl-export")
    assert "config.json" in line and words in line and "original config.json" in line


def test_export_of_weights_that_do_not_fit_the_config(small_model_dir, tmp_path, capsys):
    model = _model_copy(small_model_dir, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (model / "config.json").write_text(json.dumps(cfg))
    assert export_main(["--model", str(model), "--chunks", "0-1,2-2", "--out", str(tmp_path / "o")]) == 2
    assert "config.json and the weights belong together" in _line(capsys, "zl-export")


def test_export_with_unknown_target_modules(tmp_path, capsys):
    assert export_main(["--model", "tiny", "--target-modules", "foo_proj", "--out", str(tmp_path / "o")]) == 2
    line = _line(capsys, "zl-export")
    assert "--target-modules foo_proj: not a linear layer of a Llama block" in line and "q_proj,v_proj" in line
    assert list(tmp_path.iterdir()) == []


def test_a_killed_exports_hidden_folders_are_removed_by_the_next_run(tmp_path):
    from exporter.export import prepare_out_dir

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [tmp_path / f".o.partial-{dead.pid}-abc", tmp_path / ".o.partial-old_unstamped"]
        running = tmp_path / f".o.partial-{live.pid}-xyz"
        other = tmp_path / f".other.partial-{dead.pid}-abc"  # another output's: not ours to touch
        for p in (*stale, running, other):
            p.mkdir()
        tmp = prepare_out_dir(tmp_path / "o")
        assert tmp.name.startswith(f".o.partial-{os.getpid()}-")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, other.name, tmp.name])
    finally:
        live.kill()
        live.wait()


def test_sigterm_during_export_leaves_no_hidden_folder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "--model", "tiny", "--out", str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.time() + 120
    while not list(tmp_path.glob(".o.partial-*")) and proc.poll() is None and time.time() < end:
        time.sleep(0.05)
    assert list(tmp_path.glob(".o.partial-*")), "the export never made its temporary folder"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "zl-export: interrupted; nothing was written to" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
