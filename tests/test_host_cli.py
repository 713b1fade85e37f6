"""zl-host end to end: three emulated phones found over real mDNS, real TCP, a trained adapter
that peft loads, the report, eval; and every bad input gets one clear line."""
import json
import shutil
import socket
import sys
import time

import numpy as np
import pytest

from host.cli.zl_host import main
from host.phones.emulate import start_phones
from zl_common.data import synthetic_examples
from zl_mobile.processes import pid_alive

from .conftest import cli_error_line as _error_line  # noqa: E402


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in synthetic_examples(40, seed=3)))
    return path


@pytest.fixture(scope="module")
def e2e(small_export, data_file, tmp_path_factory):
    out = small_export[0]
    root = tmp_path_factory.mktemp("e2e")
    phones = start_phones(3, root / "phones", prefix="e2e")
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps({p.name: p.token for p in phones}))
    run = root / "run"
    try:
        rc = main(["run", "--program", str(out), "--data", str(data_file), "--devices", "auto", "--tokens", str(tokens),
                   "--steps", "4", "--window", "2", "--lr", "2e-2", "--out", str(run), "--wait", "20"])
        from host.devices.discovery import find_devices
        listing = {f.name: f.endpoint for f in find_devices(timeout=2.0)[0]}
        listing["expected"] = {p.name: p.endpoint for p in phones}
    finally:
        for p in phones:
            p.stop()
    return out, run, rc, listing


def test_run_over_mdns_trains_and_writes_adapter_and_report(e2e):
    out, run, rc, _ = e2e
    assert rc == 0
    for f in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "metrics.jsonl", "report.md",
              "loss.png", "memory.png", "timeline.png", "run.json", "summary.json"):
        assert (run / f).is_file(), f
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tel = [r for r in recs if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"]
    assert {r["device"] for r in tel} == {"e2e0", "e2e1", "e2e2"}
    for k in range(3):
        first = np.mean([r["loss"] for r in tel if r["stage"] == k and r["window"] == 0])
        last = np.mean([r["loss"] for r in tel if r["stage"] == k and r["window"] == 3])
        assert last < first, (k, first, last)
    report = (run / "report.md").read_text()
    window_rows = [line for line in report.splitlines() if line.startswith("| ") and line.count("|") == 10
                   and line.split("|")[2].strip().isdigit()]
    assert len(window_rows) == 3 * 4  # one row per stage and update window


def test_adapter_loads_in_peft_and_changes_logits(e2e, small_model_dir):
    from host.evaluation.evaluate import logits_change

    out, run, rc, _ = e2e
    batch = {"input_ids": np.array([[1, 5, 9, 12, 7, 3]], dtype=np.int64)}
    assert logits_change(str(small_model_dir), run / "adapter", batch) > 1e-4


def test_eval_runs_on_the_adapter(e2e, data_file, capsys):
    out, run, rc, _ = e2e
    capsys.readouterr()
    assert main(["eval", "--program", str(out), "--adapter", str(run / "adapter"), "--data", str(data_file)]) == 0
    text = capsys.readouterr().out
    assert "with adapter:  NLL" in text and "base model:" in text


def test_eval_shows_prompts_with_both_answers(e2e, data_file, capsys):
    """--show N: N held-out rows, each prompt (up to 'topic :') with its expected answer."""
    from transformers import AutoTokenizer

    from exporter.manifest import load_manifest
    from host.evaluation.answers import prompts_and_answers
    from host.evaluation.evaluate import split_held_out
    from host.run.data import prepare_data

    out, run, rc, _ = e2e
    _, held_out = split_held_out(prepare_data(out, load_manifest(out), str(data_file), training=False))
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    rows = prompts_and_answers(held_out, 2)
    assert len(rows) == 2
    want = [(tok.decode(p, skip_special_tokens=True).strip(), tok.decode(e, skip_special_tokens=True).strip()) for p, e in rows]
    assert all(p.endswith("topic :") and e and " " not in e for p, e in want), want
    capsys.readouterr()
    assert main(["eval", "--program", str(out), "--adapter", str(run / "adapter"), "--data", str(data_file),
                 "--show", "2"]) == 0
    text = capsys.readouterr().out
    assert "2 held-out prompts" in text and all(e in text for _, e in want)


def test_devices_lists_the_phones(e2e):
    listing = e2e[3]
    for name, endpoint in listing.pop("expected").items():
        assert listing[name] == endpoint  # found over mDNS with the port the phone listens on


def test_devices_says_where_it_looked_when_nothing_found(capsys):
    assert main(["devices", "--timeout", "0.5", "--mdns", "127.0.0.1"]) == 0
    out = capsys.readouterr().out
    assert "mDNS _zerolock._tcp on 127.0.0.1" in out and "adb" in out


def test_no_usable_devices_in_time(small_export, tmp_path, data_file, capsys):
    tokens = tmp_path / "t.json"
    tokens.write_text("{}")
    rc = main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "auto",
               "--tokens", str(tokens), "--wait", "1", "--out", str(tmp_path / "r")])
    assert rc == 2
    assert "usable device(s) of 3 needed within 1 s" in _error_line(capsys)


def test_unknown_device_names(small_export, tmp_path, data_file, capsys):
    rc = main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "nope0,nope1,nope2",
               "--wait", "1", "--out", str(tmp_path / "r")])
    assert rc == 2
    assert "unknown device(s) nope0, nope1, nope2" in _error_line(capsys)


def test_fewer_devices_than_chunks(small_export, tmp_path, data_file, capsys):
    rc = main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:2",
               "--out", str(tmp_path / "r")])
    assert rc == 2
    assert "2 emulated phone(s) for 3 chunks" in _error_line(capsys)


def test_program_dir_without_manifest(tmp_path, capsys):
    assert main(["run", "--program", str(tmp_path), "--devices", "emulated:3"]) == 2
    assert "has no manifest.json" in _error_line(capsys)


def test_program_file_hash_mismatch(small_export, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(small_export[0], bad)
    with open(bad / "chunk_1.ptd", "r+b") as f:
        f.seek(100)
        f.write(b"\x00corrupt")
    assert main(["run", "--program", str(bad), "--devices", "emulated:3"]) == 2
    line = _error_line(capsys)
    assert "chunk_1.ptd does not match its sha256" in line
    assert not (tmp_path / "r").exists()


def test_dataset_without_usable_rows(small_export, tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text('{"question": "no prompt or text here"}\n{"foo": 1}\n')
    assert main(["run", "--program", str(small_export[0]), "--data", str(data), "--devices", "emulated:3",
                 "--out", str(tmp_path / "r")]) == 2
    assert "empty.jsonl" in _error_line(capsys)


def test_unreadable_resume_dir(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "nothing")]) == 2
    assert "cannot resume" in _error_line(capsys)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text("{broken")
    assert main(["run", "--resume", str(tmp_path / "r")]) == 2
    assert "unreadable" in _error_line(capsys)


SHAPED = ["--link-mbit", "200", "--link-delay-ms", "2"]


@pytest.mark.parametrize("link", [[], SHAPED], ids=["loopback", "shaped"])
def test_host_killed_and_resumed_ends_with_the_uninterrupted_lora(small_export, data_file, tmp_path, link):
    """The host process dies mid-run (SIGKILL); `zl-host run --resume` reattaches to the running
    phones, which kept their state (shaped: in the namespaces the dead host left, taken over), and
    the adapter equals an uninterrupted run's."""
    import subprocess
    import sys
    import time

    from safetensors.numpy import load_file

    args = ["--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:3",
            "--steps", "30", "--window", "2", "--lr", "2e-2", *link]
    assert main(["run", *args, "--out", str(tmp_path / "a")]) == 0

    run = tmp_path / "b"
    host = subprocess.Popen([sys.executable, "-m", "host.cli", "run", *args, "--out", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    killed_at = None
    while time.time() < deadline and host.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and any('"CHECKPOINT_COMMITTED"' in line and '"stage": 2' in line and '"window": 2' in line
                                    for line in metrics.read_text().splitlines()):
            host.kill()
            host.wait()
            killed_at = sum(1 for _ in metrics.open())
            break
        time.sleep(0.05)
    assert killed_at is not None, "the host finished before it could be killed"
    before = json.loads((run / "run.json").read_text())
    assert main(["run", "--resume", str(run)]) == 0
    after = json.loads((run / "run.json").read_text())
    assert [p["pid"] for p in after["phones"]] == [p["pid"] for p in before["phones"]]  # reattached
    tag = after["link"]["netns_tag"]
    if link and tag:
        assert tag == before["link"]["netns_tag"]
        assert f"zl{tag}p" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert set(a) == set(b)
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    print(f"largest LoRA difference after host kill + resume: {diff:.3g}")
    assert diff <= 1e-6


def test_emulated_phones_on_shaped_links(small_export, data_file, tmp_path, capsys):
    from host.phones import netns

    run = tmp_path / "run"
    assert main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:3",
                 "--steps", "2", "--window", "2", "--link-mbit", "80", "--link-delay-ms", "5", "--out", str(run)]) == 0
    err = capsys.readouterr().err
    saved = json.loads((run / "run.json").read_text())
    assert saved["link"]["mbit"] == 80 and saved["link"]["delay_ms"] == 5
    assert all("--link-delay-ms" in p["args"] for p in saved["phones"])
    if netns.unavailable() is None:  # each phone in its own namespace, shaped by the kernel; gone afterwards
        assert "own network namespaces, 80 Mbit/s per phone and direction, 5 ms one-way latency" in err
        tag = saved["link"]["netns_tag"]
        assert tag and not any(ns.startswith(f"zl{tag}p") for ns in netns._namespaces())
    else:
        assert "the transport's rate limiter at 80 Mbit/s" in err
        assert all("--rate-mbit" in p["args"] for p in saved["phones"])
    assert json.loads((run / "summary.json").read_text())["micro_batches"] == 4


def test_held_out_zero_trains_on_every_micro_batch(small_export, data_file, tmp_path, capsys):
    """--held-out 0 (data split beforehand): an epoch is all 20 micro-batches of the 40 rows, not
    the 16 the default 0.2 leaves; the run records it for --resume."""
    run = tmp_path / "run"
    assert main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:3",
                 "--epochs", "1", "--window", "2", "--held-out", "0", "--out", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["micro_batches"] == 20
    assert json.loads((run / "run.json").read_text())["held_out"] == 0
    with pytest.raises(SystemExit):
        main(["run", "--program", str(small_export[0]), "--devices", "emulated:3", "--held-out", "1"])
    assert "--held-out: must be in [0, 1), got 1" in capsys.readouterr().err


def test_alpha_per_stage_reaches_each_stage(small_export, data_file, tmp_path, capsys):
    """--alpha 0,0.5,1: stage k's local loss is alpha_k * task + (1 - alpha_k) * consistency, each
    micro-batch (stage 0: pure KL, stage 2: pure CE); a list of the wrong length is refused."""
    run = tmp_path / "run"
    assert main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:3",
                 "--steps", "1", "--window", "2", "--alpha", "0,0.5,1", "--out", str(run)]) == 0
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    tel = [r for r in recs if r.get("type") == "TELEMETRY" and r.get("kind") == "micro_batch"]
    assert {r["stage"] for r in tel} == {0, 1, 2}
    for r in tel:
        a = (0.0, 0.5, 1.0)[r["stage"]]
        assert r["loss"] == pytest.approx(a * r["task_loss"] + (1 - a) * r["consis_loss"], rel=1e-4), r
        assert abs(r["task_loss"] - r["consis_loss"]) > 1e-3  # the two terms differ: the blend is seen
    assert json.loads((run / "run.json").read_text())["settings"]["alpha"] == [0.0, 0.5, 1.0]
    assert main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:3",
                 "--alpha", "0.5,1", "--out", str(tmp_path / "r2")]) == 2
    assert "--alpha gives 2 values for 3 stages" in _error_line(capsys)
    with pytest.raises(SystemExit):
        main(["run", "--program", str(small_export[0]), "--alpha", "0.5,1.5"])
    assert "1.5 is outside [0, 1]" in capsys.readouterr().err


def test_lr_per_stage_reaches_each_stage(small_export, data_file, tmp_path, capsys):
    """--lr 1e-6,1e-4,1e-2: each stage's AdamW steps at its own rate. LoRA B starts at zero and
    Adam's first step moves an element by at most the LR (by about it where the gradient is not
    tiny), so after one step stage k's B is bounded by, and reaches near, lr_k; a list of the
    wrong length or a rate the phones refuse is refused first."""
    import re

    from safetensors.numpy import load_file

    lrs = (1e-6, 1e-4, 1e-2)
    run = tmp_path / "run"
    assert main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:3",
                 "--steps", "1", "--window", "2", "--lr", ",".join(map(str, lrs)), "--out", str(run)]) == 0
    assert json.loads((run / "run.json").read_text())["settings"]["lr"] == list(lrs)
    stage_of = {layer: k for k, c in enumerate(small_export[1]["chunks"]) for layer in range(c["layers"][0], c["layers"][1] + 1)}
    moved = {}
    for name, t in load_file(str(run / "adapter" / "adapter_model.safetensors")).items():
        if "lora_B" in name:
            k = stage_of[int(re.search(r"layers\.(\d+)\.", name).group(1))]
            moved[k] = max(moved.get(k, 0.0), float(np.abs(t).max()))
    assert sorted(moved) == [0, 1, 2]
    for k, lr in enumerate(lrs):
        assert 0.5 * lr < moved[k] <= lr * 1.001, (k, moved[k], lr)
    assert main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "emulated:3",
                 "--lr", "1e-3,1e-3", "--out", str(tmp_path / "r2")]) == 2
    assert "--lr gives 2 values for 3 stages" in _error_line(capsys)
    with pytest.raises(SystemExit):
        main(["run", "--program", str(small_export[0]), "--lr", "1e-3,-1,1e-3"])  # 0 is a forward-only stage
    assert "-1 is not a learning rate" in capsys.readouterr().err


def test_link_options_need_emulated_phones(small_export, data_file, tmp_path, capsys):
    assert main(["run", "--program", str(small_export[0]), "--data", str(data_file), "--devices", "auto",
                 "--link-mbit", "50", "--out", str(tmp_path / "r")]) == 2
    assert "use --devices emulated:N" in _error_line(capsys)
    with pytest.raises(SystemExit):
        main(["run", "--program", str(small_export[0]), "--devices", "emulated:3", "--link-mbit", "0"])
    assert "--link-mbit: must be > 0, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_ends_a_run_as_ctrl_c_does(small_export, data_file, tmp_path, sig):
    """SIGTERM or SIGINT mid-run: the host stops the phones it started (and would remove its adb
    forwards, in the same clean-up), prints the resume hint and exits 130, instead of dying with
    orphans. The host is started with SIGINT ignored, as a script's background job is: Python keeps
    an inherited SIG_IGN unless the host installs its own handler."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    host = subprocess.Popen([sys.executable, "-m", "host.cli", "run", "--program", str(small_export[0]),
                             "--data", str(data_file), "--devices", "emulated:3", "--steps", "200", "--window", "2",
                             "--out", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 120
    while time.time() < deadline and host.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and '"CHECKPOINT_COMMITTED"' in metrics.read_text():
            break
        time.sleep(0.05)
    assert host.poll() is None, "the host finished before it could be stopped"
    pids = [p["pid"] for p in json.loads((run / "run.json").read_text())["phones"]]
    assert len(pids) == 3 and all(pid_alive(pid) for pid in pids)
    host.send_signal(getattr(signal, sig))
    _, err = host.communicate(timeout=60)
    assert host.returncode == 130, err
    assert "zl-host run --resume" in err
    assert not any(pid_alive(pid) for pid in pids), f"emulated phones left running after {sig}"



@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_run_and_eval_on_quantized_base_weights(fmt, data_file, tmp_path, capsys, request):
    """zl-host run trains an int8- or int4-base export (XNNPACK, emulated phones); eval uses that base."""
    out = request.getfixturevalue(f"small_export_{fmt}")[0]
    run = tmp_path / "run"
    assert main(["run", "--program", str(out), "--data", str(data_file), "--devices", "emulated:3",
                 "--steps", "2", "--window", "2", "--lr", "2e-2", "--out", str(run)]) == 0
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"]
    assert len(losses) == 3 * 4 and all(np.isfinite(losses))
    capsys.readouterr()
    assert main(["eval", "--program", str(out), "--adapter", str(run / "adapter"), "--data", str(data_file)]) == 0
    text = capsys.readouterr().out
    assert f"(base weights {fmt}, as trained)" in text and "with adapter:  NLL" in text


def test_greedy_answers_are_the_argmax_continuation(small_model_dir):
    """host.evaluation.answers decodes with transformers' generate: the same tokens as taking the argmax one
    step at a time, stopping before the eos."""
    import torch

    from exporter.model_source import load_model_dir
    from host.evaluation.answers import _greedy

    model = load_model_dir(small_model_dir).eval()
    ids = torch.tensor([[5, 9, 11, 3, 7]])
    with torch.no_grad():
        reference, x = [], ids
        for _ in range(6):
            t = int(model(input_ids=x).logits[0, -1].argmax())
            reference.append(t)
            x = torch.cat([x, torch.tensor([[t]])], dim=1)
        assert _greedy(model, ids, 6, eos=None) == reference
        stop = reference[3]  # as if that token were the eos
        assert _greedy(model, ids, 6, eos=stop) == reference[:reference.index(stop)]


def test_a_zombie_is_not_alive_and_a_dying_phone_is_not_adopted(tmp_path):
    """An orphan killed with its host may linger as a zombie no one reaps, and a phone SIGKILLed a
    moment ago can still complete a connection in its backlog: neither is a phone to adopt."""
    import subprocess

    from host.phones.emulated_phone import EmulatedPhone
    from zl_mobile.processes import wait_gone

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[0] != "Z" and time.time() < deadline:
        time.sleep(0.02)  # exited, not reaped yet: a zombie
    assert not pid_alive(child.pid) and wait_gone(child.pid, 1.0)
    child.wait()

    # a listener that accepts into its backlog but never speaks (as a process being killed)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(4)
    try:
        phone = EmulatedPhone("mute", tmp_path / "w", "ab" * 32, [], mute.getsockname()[1])
        assert not phone._answers()
    finally:
        mute.close()


def test_run_options_and_run_config_agree():
    """`zl-host run`'s options are RunConfig's fields, with the same defaults: what a bench or test
    builds in code is what the command line gives (an option added to one and not the other fails)."""
    from dataclasses import fields

    from host.cli.zl_host import build_parser
    from host.run.config import RunConfig

    parser = build_parser()
    run_parser = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    options = {a.dest for a in run_parser._actions if a.dest != "help"} - {"func"}
    assert options == {f.name for f in fields(RunConfig)}
    assert RunConfig.from_args(parser.parse_args(["run", "--program", "p"])) == RunConfig(program="p")
    cfg = RunConfig.from_args(parser.parse_args(["run", "--program", "p", "--alpha", "0.5,1", "--inject-failure",
                                                 "stage=1,window=0", "--devices", "emulated:3"]))
    assert cfg.alpha == [0.5, 1.0] and cfg.emulated_count() == 3
    assert cfg.failures() == [{"stage": 1, "window": 0, "point": "after-phase1"}]
