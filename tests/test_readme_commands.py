"""The READMEs as tests: every command of README.md's usage blocks and kotlin_app/README.md, run in
the order a reader meets them, as written but for paths, sizes and placeholders
(tests/readme_commands.py reads the blocks). A drifted flag or a removed option fails here.

The reader's shell: a work dir holding `TinyLlama-1.1B` (the small test model), `ag_news.csv` and
`D.jsonl` (the synthetic set), HOME in tmp (so `--devices auto` finds this test's phones' tokens,
none of another test's), the venv's programs on PATH. Long-lived `zl-host emulate` commands are
started, used by the block's `zl-host devices` and `--devices auto` runs, and stopped by the pids
they print. Commands that cannot run here are skipped with the reason, their flags checked
against the program's --help (tests/readme_commands.py CANNOT_RUN)."""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zl_common.data.synthetic import LABELS, synthetic_examples

from .conftest import SMALL_CHUNKS
from .readme_commands import ROOT, all_commands, cannot_run, comment_flags, help_command, parse, placeholders

COMMANDS = all_commands()
FIRST_EXPORT = next((c for c in COMMANDS if c.argv[:1] == ["zl-export"]), None)
# --window stays as written: the BP schedules need one of at least the stage count
SIZES = {"--steps": "2", "--windows": "2", "--rounds": "1", "--seq-len": "16"}
EXPORT_DIR = "build/tinyllama"  # what EXPORT stands for: the README's own export above
TIMEOUT = 600


class Reader:
    """Runs the README's commands in one work dir, as a reader's shell would."""

    def __init__(self, tmp: Path, model_dir: Path):
        self.cwd = tmp / "reader"
        self.cwd.mkdir()
        (self.cwd / "TinyLlama-1.1B").symlink_to(model_dir)
        examples = synthetic_examples(40, seed=3)
        (self.cwd / "D.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
        with open(self.cwd / "ag_news.csv", "w", newline="") as f:  # AG News rows: class index, title, description
            w = csv.writer(f)
            for e in examples:
                w.writerow([LABELS.index(e["completion"].strip()) + 1, "news", e["prompt"]])
        bindir = str(Path(sys.executable).parent)
        # torchrun's rendezvous on a port of its own (PET_ is torchrun's environment form of --master-port),
        # not the default 29500 another test may hold
        self.env = dict(os.environ, HOME=str(tmp / "home"), PATH=bindir + os.pathsep + os.environ["PATH"],
                        PYTHONUNBUFFERED="1", PET_MASTER_PORT=str(_free_port()))
        self.done: dict[tuple, str] = {}   # commands run, as substituted -> where first
        self.users_run: set[str] = set()   # ids run while an emulate was up
        self.last_run: list[str] = []      # the `zl-host run` the README's `...` continues
        self.helps: dict[tuple, str] = {}

    # ------------------------------------------------------------ substitution: paths, sizes, placeholders
    def substitute(self, cmd) -> list[str]:
        argv = cmd.argv
        out: list[str] = []
        i = 0
        while i < len(argv):
            w = argv[i]
            if w in SIZES and i + 1 < len(argv):
                out += [w, SIZES[w]]
                i += 2
                continue
            if w == "--chunks" and i + 1 < len(argv) and re.fullmatch(r"\d+-\d+(,\d+-\d+){2}", argv[i + 1]):
                out += [w, SMALL_CHUNKS]  # three chunks of the small model's three layers
                i += 2
                continue
            if w == "EXPORT":
                w = EXPORT_DIR
            elif w == "...":  # "the rest as in the run above": its data and sizes
                out += self.last_run
                i += 1
                continue
            elif not (self.cwd / w).exists() and "/" in w and (ROOT / w).is_file():
                w = str(ROOT / w)  # the repository's scripts (bench/, kotlin_app/) from the reader's dir
            out.append(w)
            i += 1
        prog = out[:2]
        if out[0] == "zl-export":  # not finetune: its --seq-len auto fits the chat rows (16 would cut every answer)
            out += [] if "--seq-len" in out else ["--seq-len", SIZES["--seq-len"]]
            if cmd is FIRST_EXPORT:  # the torchrun section asks this export for --eager-weights in its text
                out.append("--eager-weights")
        if prog == ["zl-host", "run"] or "host.dist" in out or "kotlin_phone.py" in " ".join(out):
            out += [] if "--steps" in out or "--windows" in out else (
                ["--windows", "2"] if "kotlin_phone.py" in " ".join(out) else ["--steps", SIZES["--steps"]])
        if "kotlin_phone.py" in " ".join(out):
            out += ["--rounds", "1", "--work", str(self.cwd / "bench-work")] if "--rounds" not in out else \
                ["--work", str(self.cwd / "bench-work")]
        if prog == ["zl-host", "emulate"]:  # its own names: no namesake among other tests' phones on loopback
            out += ["--prefix", f"rd{os.getpid()}L{cmd.line}-"]
        left = placeholders(out)
        assert not left, f"{cmd.doc}:{cmd.line}: placeholder(s) {left} with no substitution in the test: {cmd.text}"
        return out

    # ------------------------------------------------------------ running
    def run(self, argv: list[str], cmd, timeout: float = TIMEOUT) -> str:
        shell = any(w in argv for w in (">", "&&", "|"))
        t0 = time.time()
        r = subprocess.run(" ".join(argv) if shell else argv, shell=shell, cwd=self.cwd, env=self.env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        out = r.stdout + r.stderr
        assert r.returncode == 0, (f"{cmd.doc}:{cmd.line} exit {r.returncode} after {time.time() - t0:.0f} s: "
                                   f"{' '.join(argv)}\n{out[-3000:]}")
        if argv[:2] == ["zl-host", "run"] and "--plan" not in argv:
            self.last_run = [w for k, w in enumerate(argv) if k + 1 < len(argv)
                             for w in (argv[k], argv[k + 1]) if argv[k] in ("--data", "--steps", "--window")]
        return out

    def help_text(self, argv: list[str]) -> str:
        key = tuple(argv)
        if key not in self.helps:
            r = subprocess.run(argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=120)
            self.helps[key] = r.stdout + r.stderr
            assert r.returncode == 0, f"{' '.join(argv)} exit {r.returncode}: {self.helps[key][-2000:]}"
        return self.helps[key]

    # ------------------------------------------------------------ long-lived phones
    def emulate(self, argv: list[str], cmd, users: list) -> None:
        """Start `zl-host emulate`, run the block's commands that use its phones, stop it by its pids."""
        proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        phones, pids, lines = {}, [], []
        try:
            deadline = time.time() + 300
            while time.time() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
                m = re.match(r"(\S+): \S+ pid (\d+), (\w+) runtime", line)
                if m:
                    phones[m.group(1)] = m.group(3)
                m = re.search(r"Stop them with: kill ([\d ]+)", line)
                if m:
                    pids = [int(p) for p in m.group(1).split()]
                    break
            assert pids, f"{cmd.doc}:{cmd.line}: {' '.join(argv)} did not say its phones run:\n{''.join(lines)[-3000:]}"
            for use in users:
                uargv = self.substitute(use)
                if uargv[:2] == ["zl-host", "run"]:
                    uargv = self._own_out(uargv, use, phones)
                    if uargv is None:
                        continue
                out = self.run(uargv, use)
                if uargv[:2] == ["zl-host", "devices"]:  # each phone listed, with its runtime
                    for name, runtime in phones.items():
                        want = "kotlin/executorch" if runtime == "kotlin" else "zl_mobile/"
                        row = next((ln for ln in out.splitlines() if ln.split()[:1] == [name]), "")
                        assert want in row, f"zl-host devices does not list {name} ({runtime}):\n{out[-3000:]}"
                self.users_run.add(use.id)
            for pid in pids:  # as the emulate says: kill PIDS
                os.kill(pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, f"{' '.join(argv)} exit {proc.returncode} after its phones were stopped"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            proc.stdout.close()

    def _own_out(self, argv: list[str], use, phones: dict) -> list[str] | None:
        """A `--devices auto` run once per runtime among the alternatives (the same out dir for the
        last one, which the commands after it read; its own for the others)."""
        runtime = next(iter(phones.values()))
        self.ran_auto = getattr(self, "ran_auto", {})
        if runtime in self.ran_auto:
            return None
        self.ran_auto[runtime] = use.id
        if not getattr(self, "final_emulate", False):
            k = argv.index("--out") + 1
            argv = argv[:k] + [argv[k] + f"-{runtime}"] + argv[k + 1:]
        return argv


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uses_phones(cmd) -> bool:
    """Needs long-lived phones on mDNS: zl-host devices, or a run/profile that finds its devices."""
    a = cmd.argv
    if a[:2] == ["zl-host", "devices"]:
        return True
    if a[:2] in (["zl-host", "run"], ["zl-host", "profile"]) and "--devices" in a:
        return not a[a.index("--devices") + 1].startswith("emulated:")
    return False


@pytest.fixture(scope="module")
def reader(small_model_dir, tmp_path_factory):
    return Reader(tmp_path_factory.mktemp("readme"), small_model_dir)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_readme_command(cmd, reader):
    skip = cannot_run(cmd)
    if skip:
        reason, helps = skip
        if helps:  # every flag it shows exists
            text = "".join(reader.help_text([str(x).format(classpath=_classpath()) for x in h]) for h in helps)
            missing = [f for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cmd.text) if f not in text]
            assert not missing, f"{cmd.doc}:{cmd.line}: {missing} not in {' / '.join(h[0] for h in helps)} --help"
        pytest.skip(f"{cmd.doc}:{cmd.line}: {reason}")
    if cmd.id in reader.users_run:
        return  # run above, while the emulate before it was up
    argv_key = tuple(reader.substitute(cmd)) if cmd.argv[:2] != ["zl-host", "emulate"] else None
    if argv_key is not None and argv_key in reader.done:
        return  # the same command (once substituted) as one run above
    if cmd.argv[:2] == ["zl-host", "emulate"]:
        key = tuple(cmd.argv)
        if key in reader.done:
            return
        block = _block_of(cmd)
        group_end = next((k for k in range(block.index(cmd), len(block)) if block[k].argv[:2] != ["zl-host", "emulate"]),
                         len(block))
        reader.final_emulate = block.index(cmd) == group_end - 1  # the last alternative: its run is the one read on
        users = [c for c in block[group_end:] if _uses_phones(c)]
        reader.emulate(reader.substitute(cmd), cmd, users)
        reader.done[key] = cmd.id
        return
    reader.run(list(argv_key), cmd)
    reader.done[argv_key] = cmd.id


def _block_of(cmd) -> list:
    """The commands of `cmd`'s fenced block."""
    doc = [c for c in COMMANDS if c.doc == cmd.doc]
    k = doc.index(cmd)
    start = max(j for j in range(k + 1) if doc[j].first_of_block)
    end = next((j for j in range(k + 1, len(doc)) if doc[j].first_of_block), len(doc))
    return doc[start:end]


def _classpath() -> str:
    return (ROOT / "kotlin_app" / "build" / "classpath.txt").read_text().strip()


OPTIONED = [c for c in COMMANDS if comment_flags(c)]


@pytest.mark.parametrize("cmd", OPTIONED, ids=[c.id for c in OPTIONED])
def test_readme_options_exist(cmd, reader):
    """The options a comment lists beside a command are the program's (or the program it names)."""
    missing = _missing_options(cmd, reader.help_text)
    assert not missing, f"{cmd.doc}:{cmd.line}: the README lists {missing}, which its --help does not have"


def _missing_options(cmd, help_text) -> list[str]:
    missing = []
    for flag, named in comment_flags(cmd):
        h = [named, "--help"] if named else help_command(cmd.argv)
        if h and flag not in help_text(h):
            missing.append(flag)
    return missing


def test_a_drifted_flag_or_a_removed_option_fails(tmp_path, reader):
    """The runner's own check: a block with an option the program lost is caught both ways."""
    doc = "## Using it\n\n```bash\nzl-host eval --program P --adapter A --data D --shw 2\n" \
          "#    options: --show N --no-such-option\n```\n"
    (cmd,) = parse("README.md", doc)
    assert _missing_options(cmd, reader.help_text) == ["--no-such-option"]
    r = subprocess.run(cmd.argv, cwd=reader.cwd, env=reader.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--shw" in r.stderr
