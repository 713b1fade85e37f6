"""The READMEs' shell commands as data, for tests/test_readme_commands.py: the fenced blocks read in
the order a reader meets them, each command with the comment lines that follow it (their option
lists are checked against the program's --help), and the few substitutions the tests may make
(paths, sizes, placeholders) so that every flag as written reaches the real program."""
from __future__ import annotations

import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "kotlin_app/README.md")
SKIPPED_SECTIONS = {"The two commands"}  # scripts/demo.sh and scripts/test.sh: CI runs them itself

# Commands that cannot run here, each with why; their flags are checked against `help` where one exists.
# (pattern on the command as written, reason, the help command whose text must hold every --flag, or None)
CANNOT_RUN = [
    (r"^llama-cli\b", "llama.cpp is not installed here "
     "(the adapter's format: docs/BENCHMARKS.md, tests/test_gguf_adapter.py)", None),
    (r"\bollama create\b", "Ollama is not installed here", None),
    (r"^tensorboard\b", "starts a server that never ends (its event files: tests/test_tensorboard.py)",
     ["tensorboard", "--help"]),
    (r"^torchrun --nnodes", "needs three machines; the one-machine torchrun above runs the same ranks",
     ["torchrun", "--help"], ["python", "-m", "host.dist", "--help"]),
    (r"python -m pytest tests/", "a file of this very suite", None),
    (r"^(bash )?kotlin_app/run_tests\.sh$", "the JVM tests: scripts/test.sh runs them (CI); the Kotlin phones below "
     "build what they need (run_tests.sh --build-only)", None),
    (r"^(cd kotlin_app|gradle |echo \"sdk\.dir|\./gradlew |adb install)",
     "needs the Android SDK and Google's Maven (not here)", None),
    (r"^java .*DeviceMain", "by hand, with [optional] arguments: zl-host emulate --runtime kotlin starts it above",
     ["java", "-cp", "{classpath}", "org.zerolock.core.device.DeviceMain", "--help"]),
]
# a command's program for its --help: the first words that name it
HELP_OF = {"zl-host": 2, "zl-export": 1, "zl-phone": 1, "zl-dist": 1, "torchrun": 1}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclass
class Command:
    doc: str
    section: str
    line: int                 # where it starts in doc
    text: str                 # continuations joined, its own comment cut off
    comments: list[str] = field(default_factory=list)  # the block's comment lines after it, its trailing one first
    first_of_block: bool = False

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def id(self) -> str:
        words = [w for w in self.argv if not w.startswith("-")][:3]
        return f"{self.doc.removesuffix('.md')}:{self.line}:" + "-".join(re.sub(r"[^\w.]+", "_", w)[:24] for w in words)


def _is_command_block(lang: str, lines: list[str]) -> bool:
    """A shell block: labelled bash/sh, or unlabelled with a first command that names a program
    (kotlin_app/README.md's layout tree is a block too, of folder names)."""
    if lang in ("bash", "sh", "shell", "console"):
        return True
    if lang:
        return False
    first = next((ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")), "")
    word = first.split()[0] if first else ""
    return bool(word) and (shutil.which(word) is not None or (ROOT / word).is_file()
                           or word in (".", "cd", "gradle", "llama-cli", "ollama"))


def _cut_comment(line: str) -> tuple[str, str]:
    """(command part, trailing comment) of a line: the first ` #` outside quotes starts the comment."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def parse(doc: str, text: str | None = None) -> list[Command]:
    """The commands of `doc`'s fenced shell blocks, in order, outside SKIPPED_SECTIONS."""
    lines = (text if text is not None else (ROOT / doc).read_text()).splitlines()
    out: list[Command] = []
    section, i = "", 0
    while i < len(lines):
        m = re.match(r"^(#{1,6}) (.*)", lines[i])
        if m:
            section = m.group(2).strip()
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        body = lines[i + 1:j]
        if section not in SKIPPED_SECTIONS and _is_command_block(fence.group(1), body):
            out += _commands(doc, section, i + 2, body)
        i = j + 1
    return out


def _commands(doc: str, section: str, first_line: int, body: list[str]) -> list[Command]:
    cmds: list[Command] = []
    k = 0
    while k < len(body):
        part, comment = _cut_comment(body[k])
        if not part:  # a comment line: it documents the command above it
            if comment and cmds:
                cmds[-1].comments.append(comment)
            k += 1
            continue
        start, text, trailing = k, part, [comment] if comment else []
        while text.endswith("\\") and k + 1 < len(body):
            k += 1
            part, comment = _cut_comment(body[k])
            text = text[:-1].rstrip() + " " + part.strip()
            trailing += [comment] if comment else []
        cmds.append(Command(doc, section, first_line + start, text, trailing, first_of_block=not cmds))
        k += 1
    return cmds


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in parse(doc)]


def cannot_run(cmd: Command):
    """(reason, help commands) if `cmd` is on the CANNOT_RUN list, else None."""
    for pattern, reason, *helps in CANNOT_RUN:
        if re.search(pattern, cmd.text):
            return reason, [h for h in helps if h]
    return None


def help_command(argv: list[str]) -> list[str] | None:
    """The --help of the program (and zl-host subcommand) `argv` runs, or None."""
    if argv[:3] == ["python", "-m", "host.dist"] or "host.dist" in argv:
        return ["python", "-m", "host.dist", "--help"]
    n = HELP_OF.get(argv[0]) if argv else None
    return argv[:n] + ["--help"] if n else None


def comment_flags(cmd: Command) -> list[tuple[str, str | None]]:
    """(flag, program the comment names or None) for every --flag in the comments after `cmd`:
    options the README documents beside it, which must exist."""
    out, named = [], None
    for c in cmd.comments:  # a line that starts with a flag goes on with the program the line above named
        named = next((p for p in ("zl-phone", "torchrun") if p in c.split()), named if c.startswith("--") else None)
        for f in FLAG.findall(c):
            out.append((f, named))
    return out


PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9](\.[a-z]+)?\b")  # EXPORT, D.jsonl, BASE.gguf, NODE, HOST0


def placeholders(argv: list[str]) -> list[str]:
    """Words the reader is to replace (all capitals, maybe with an extension), left in a command."""
    return [w for w in argv if re.fullmatch(r"[A-Z][A-Z0-9_]*[A-Z0-9](\.[a-z]+)?|\.\.\.", w)]
