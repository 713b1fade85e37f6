"""zl-host finetune --model M --data D --devices auto|emulated:N: from a data file to an adapter in
one command. The data is read and checked first (a malformed row stops it before anything is
started or written); then

1. export: zl-export's programs for M, reused from the export cache when the same model (its
   files' names, sizes and times) was exported with the same settings (the key is their sha256);
2. train: zl-host run on the phones, the last --held-out share of D kept out;
3. eval: on that held-out share, the base model against the adapter (zl-host eval's numbers and
   generated answers), written to RUN/eval.json and RUN/report.md;
4. adapters: RUN/adapter (PEFT) and RUN/export/adapter.gguf (llama.cpp --lora).

The separate commands (zl-export, zl-host run, eval, export) stay for finer control."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from ..run.config import add_run_options
from .error import CliError

console = Console(stderr=True, soft_wrap=True)
STEPS = 4
SEQ_ROUND, SEQ_MAX = 16, 512  # --seq-len auto: a multiple of 16, never more than 512 (longer rows are cut)
DEFAULT_CACHE = Path(os.environ.get("ZL_EXPORT_CACHE", Path.home() / ".cache" / "zerolock" / "exports"))


def add_parser(sub, add_generation_args) -> None:
    f = sub.add_parser("finetune", help="export (cached), train on the phones, evaluate and write the adapters: one command",
                       description=__doc__.split("\n", 1)[1])
    f.add_argument("--model", required=True, help="as zl-export --model: a HF Llama dir, FILE.gguf, smollm2 or tiny")
    f.add_argument("--data", required=True, help="chat JSONL ({\"messages\": [...]}), prompt/completion or text JSONL, "
                                                 "AG News CSV, Parquet (the same columns), or wordnet[-reverse][:split]")
    add_run_options(f, ["devices"])
    f.add_argument("--chunks", default=None, help="layer ranges, one per phone (default: the layers split evenly over "
                                                  "N phones for emulated:N or a name list, else over 3)")
    add_run_options(f, ["out"])
    f.add_argument("--cache", default=str(DEFAULT_CACHE), help="export cache (default %(default)s; $ZL_EXPORT_CACHE)")
    f.add_argument("--seq-len", default="auto", help="as zl-export's, or auto (default): the longest row's tokens "
                                                     f"rounded up to {SEQ_ROUND}, at most {SEQ_MAX}")
    for name, kind, default in (("--micro-batch", int, 1), ("--lora-rank", int, 8),
                                ("--lora-alpha", float, 16.0)):
        f.add_argument(name, type=kind, default=default, help="as zl-export's (default %(default)s)")
    f.add_argument("--loss-positions", type=int, default=None,
                   help="as zl-export's: answer positions a micro-batch reads out (default micro-batch x seq-len)")
    f.add_argument("--base-weights", default="fp32", help="as zl-export's: fp32, int8 or int4")
    f.add_argument("--backend", default="xnnpack", help="as zl-export's: xnnpack or portable")
    f.add_argument("--readout", default="auto", help="as zl-export's; a lens is calibrated on --data")
    # zl-host run's definitions (host/run/config.py); --held-out is also what is evaluated on
    add_run_options(f, ["steps", "epochs", "window", "lr", "held_out", "alpha"],
                    help={"held_out": "share of D kept out of training and evaluated on (default %(default)s)"})
    add_generation_args(f)
    f.set_defaults(func=cmd_finetune)


def step(k: int, what: str) -> None:
    console.print(f"[bold]finetune [{k}/{STEPS}][/] {what}")


def cmd_finetune(a) -> int:
    from zl_common.data import DataError, load_examples

    if not 0 < a.held_out < 1:
        raise CliError(f"--held-out {a.held_out}: finetune evaluates on the held-out share, give one in (0, 1)")
    try:
        examples = load_examples(a.data)  # a malformed row stops here: nothing started or written
    except DataError as e:
        raise CliError(str(e)) from None
    console.print(f"data: {a.data}: {len(examples)} rows", markup=False)
    if a.seq_len == "auto":
        a.seq_len = auto_seq_len(a.model, examples)
    elif not str(a.seq_len).isdigit():
        raise CliError(f"--seq-len {a.seq_len!r}: give a number of tokens or auto")
    try:
        program = cached_export(a)
    except KeyboardInterrupt:  # not zl-host run's resume hint: there is no run yet
        raise CliError("interrupted during the export: nothing was cached; run the same zl-host finetune again") from None
    step(2, f"train on {a.devices}")
    from ..run.config import RunConfig
    from ..run.job import run

    run_dir = run(RunConfig(program=str(program), data=a.data, devices=a.devices, steps=a.steps, epochs=a.epochs,
                            window=a.window, lr=a.lr, alpha=a.alpha, held_out=a.held_out, out=a.out))
    step(3, "eval on the held-out share: base model against the adapter")
    from .eval import run_eval

    result = run_eval(program, run_dir / "adapter", a.data, console, generate=a.generate, show=a.show,
                      seed=a.seed if a.sample else None, max_new_tokens=a.max_new_tokens)
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2))
    _append_report(run_dir / "report.md", result)
    step(4, "adapters: PEFT and GGUF")
    from ..outputs.adapter_check import AdapterError
    from ..outputs.gguf_adapter import write_gguf_adapter
    from .export import resolve_run

    adapter, _, manifest, base = resolve_run(run_dir)
    try:
        gguf = write_gguf_adapter(adapter, base, run_dir / "export" / "adapter.gguf", manifest.get("lora"),
                                  name=f"{run_dir.name} LoRA")
    except AdapterError as e:
        raise CliError(str(e)) from None
    print(f"PEFT adapter: {adapter}\nGGUF adapter: {gguf}  (llama-cli -m {base if base.is_file() else 'BASE.gguf'} "
          f"--lora {gguf})\nreport: {run_dir / 'report.md'}  eval: {run_dir / 'eval.json'}")
    return 0


def cached_export(a) -> Path:
    """The export for a's model and settings: from the cache, else made there (step 1)."""
    from exporter.errors import ExportError
    from exporter.manifest import ManifestError

    out, settings, cfg, calibration = export_plan(a)
    if (out / "manifest.json").is_file():
        step(1, f"export: reusing {out} (the same model and settings were exported before)")
        return out
    step(1, f"export {a.model} in chunks {settings['chunks']} to {out}")
    from exporter.export import export_model

    t0 = time.time()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        export_model(a.model, settings["chunks"], out, cfg, calibration=calibration,
                     progress=lambda m: console.print(f"[dim]{time.time() - t0:6.1f}s[/] {m}"))
    except (ExportError, ManifestError) as e:
        raise CliError(str(e)) from None
    (out / "finetune_key.json").write_text(json.dumps(settings, indent=2, default=str))
    return out


def export_plan(a) -> tuple[Path, dict, object, str | None]:
    """(the cache folder, the settings its key hashes, the ExportConfig, the calibration data) for a,
    checked as zl-export checks its options."""
    from exporter.chunk_spec import parse_chunk_spec
    from exporter.cli import build_parser, config_from_args, readout_from_args
    from exporter.errors import ExportError
    from exporter.manifest import ManifestError
    from exporter.model_source import resolve_model, source_num_layers

    try:
        source, path = resolve_model(a.model)
        layers = source_num_layers(source, path)
        chunks = a.chunks or even_chunks(layers, _phones(a.devices))
        parse_chunk_spec(chunks, layers)
        ns = build_parser().parse_args(["--model", a.model, "--chunks", chunks, "--out", "-", "--seq-len", str(a.seq_len),
                                        "--micro-batch", str(a.micro_batch), "--lora-rank", str(a.lora_rank),
                                        "--lora-alpha", str(a.lora_alpha), "--base-weights", a.base_weights,
                                        "--backend", a.backend, "--readout", a.readout, "--calibration-data", a.data]
                                       + (["--loss-positions", str(a.loss_positions)] if a.loss_positions else []))
        cfg = config_from_args(ns)
        readout, calibration = readout_from_args(ns)
    except (ExportError, ManifestError) as e:
        raise CliError(str(e)) from None
    settings = {"model": model_identity(source, path), "chunks": chunks, "config": asdict(cfg),
                "calibration": data_identity(calibration) if readout == "lens" and calibration else None}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(a.cache) / key, settings, cfg, calibration


def auto_seq_len(model: str, examples) -> int:
    """The longest row's tokens with the model's own tokenizer (and chat template), rounded up."""
    from exporter.errors import ExportError
    from exporter.model_source import resolve_model
    from zl_common.data import encode_examples

    try:
        source, path = resolve_model(model)
    except ExportError as e:
        raise CliError(str(e)) from None
    if source == "tiny":
        from exporter.tiny_tokenizer import build_tiny_tokenizer
        tok = build_tiny_tokenizer()
    elif source in ("gguf", "smollm2"):
        from exporter.gguf_model import load_gguf_tokenizer
        tok = load_gguf_tokenizer(path)
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
    longest = max(len(e.input_ids) for e in encode_examples(examples, tok, 1 << 30))
    seq_len = min(SEQ_MAX, -(-longest // SEQ_ROUND) * SEQ_ROUND)
    console.print(f"seq-len {seq_len}: the longest row has {longest} tokens"
                  + (f" (longer rows are cut at {SEQ_MAX})" if longest > SEQ_MAX else ""), markup=False)
    return seq_len


def _phones(devices: str) -> int:
    from ..run.config import emulated_count

    if devices.startswith("emulated:"):
        return emulated_count(devices)
    return 3 if devices == "auto" else len(devices.split(","))


def even_chunks(layers: int, n: int) -> str:
    """'0-6,7-13,14-21': n contiguous ranges, the earlier ones no longer than the later."""
    if not 1 <= n <= layers:
        raise CliError(f"{n} phones for a {layers}-layer model: give between 1 and {layers} (or --chunks)")
    bounds = [layers * k // n for k in range(n + 1)]
    return ",".join(f"{bounds[k]}-{bounds[k + 1] - 1}" for k in range(n))


def model_identity(source: str, path: Path | None) -> dict:
    """What makes an export the same model's: the source, and its files' names, sizes and times."""
    if path is None:
        return {"source": source}
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {"source": source, "path": str(path),
            "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]}


def data_identity(spec: str) -> str:
    p = Path(spec)
    return f"{spec} {p.stat().st_size} {p.stat().st_mtime_ns}" if p.is_file() else spec


def _append_report(report: Path, result: dict) -> None:
    b, a = result["base"], result["adapter"]
    lines = ["", "## Held-out eval (zl-host finetune)", "",
             "| | NLL | token accuracy | exact match | token F1 |", "|---|---|---|---|---|"]
    g = result.get("generated") or {}
    for name, m in (("base model", b), ("with adapter", a)):
        key = "base" if name == "base model" else "adapter"
        gm = g.get(key, {})
        lines.append(f"| {name} | {m['nll']:.4f} | {m['accuracy']:.3f} | "
                     f"{gm.get('exact_match', float('nan')):.3f} | {gm.get('f1', float('nan')):.3f} |")
    if g.get("rows"):
        lines += ["", f"Generated answers ({g['decoding']}), the first few:", "",
                  "| expected | base model | with adapter |", "|---|---|---|"]
        cell = lambda t: t.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines += [f"| {cell(r['expected'])} | {cell(r['base'])} | {cell(r['adapter'])} |" for r in g["rows"][:5]]
    with open(report, "a") as f:
        f.write("\n".join(lines) + "\n")
