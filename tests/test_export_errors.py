"""Bad input to zl-export: one clear line, a non-zero exit, and nothing left behind."""
import json
import subprocess
import sys

import pytest

from exporter.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "exporter.cli", *args], capture_output=True, text=True, timeout=300)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("zl-export: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_bad_chunk_spec_on_tiny(tmp_path):
    r = run_cli("--model", "tiny", "--chunks", "0-6,8-21", "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    line = _one_error_line(r.stderr)
    assert "7-7 uncovered" in line and "22 layers" in line
    assert not (tmp_path / "o").exists()
    assert list(tmp_path.iterdir()) == []  # no partial directory left behind


@pytest.mark.parametrize("setup,fragment", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "has no config.json"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))), "not a Llama"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{not json")), "not valid JSON"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps({"model_type": "llama"}))), "no *.safetensors"),
])
def test_bad_model_dirs(tmp_path, capsys, setup, fragment):
    model = tmp_path / "model"
    setup(model)
    assert main(["--model", str(model), "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert fragment in line
    assert not (tmp_path / "o").exists()


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["--model", "tiny", "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot write into" in err and "writable --out" in err


def test_nonempty_foreign_output_dir_is_refused(tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "precious.txt").write_text("keep me")
    assert main(["--model", "tiny", "--out", str(tmp_path / "o")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "o" / "precious.txt").read_text() == "keep me"


def test_bad_alpha(tmp_path, capsys):
    assert main(["--model", "tiny", "--alpha", "1.5", "--out", str(tmp_path / "o")]) == 2
    assert "outside [0, 1]" in capsys.readouterr().err


def test_interrupted_export_leaves_nothing(small_model_dir, tmp_path, monkeypatch):
    from exporter import export as export_mod
    from tests.conftest import small_export_config

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, "lower_two_phase", boom)
    with pytest.raises(KeyboardInterrupt):
        export_mod.export_model(str(small_model_dir), "0-1,2-2", tmp_path / "o", small_export_config())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ops", ["all", "gemm"])
def test_cli_exports_with_xnnpack_and_verifies(small_model_dir, tmp_path, ops):
    """Both XNNPACK variants (--xnnpack-ops: everything it can run, or GEMMs only) match eager
    PyTorch in ExecuTorch's runtime, and the manifest records which one a program is."""
    out = tmp_path / "xnn"
    r = run_cli("--model", str(small_model_dir), "--chunks", "0-1,2-2", "--out", str(out), "--seq-len", "16",
                "--lora-rank", "4", "--loss-positions", "8", "--backend", "xnnpack", "--xnnpack-ops", ops,
                "--verify")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "verify: every chunk matches eager PyTorch" in r.stderr
    from exporter.manifest import load_manifest
    m = load_manifest(out)
    assert m["export"]["backend"] == "xnnpack" and m["export"]["xnnpack_ops"] == ops and len(m["chunks"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["xnn"]  # the temporary folder was renamed, none left
