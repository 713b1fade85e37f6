"""zl-host eval (and zl-host finetune's eval step): on the held-out micro-batches, the answer tokens'
NLL and accuracy, then answers generated to the held-out questions scored by exact match and token
F1, base model against adapter, with a side-by-side table of a few."""
from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from .error import CliError


def run_eval(program: Path, adapter: Path, data: str | None, console: Console, *, generate: int = 32,
             show: int = 3, seed: int | None = None, max_new_tokens: int | None = None) -> dict:
    """Print the eval and return {"base": {...}, "adapter": {...}, "generated": {...}} (generated
    only where generate > 0 and the rows have a prompt)."""
    from exporter.errors import ModelDirError
    from exporter.manifest import ManifestError, load_manifest

    from ..evaluation.evaluate import split_held_out
    from ..outputs.adapter import base_model_path

    try:
        manifest = load_manifest(program, check_files=False)
    except ManifestError as e:
        raise CliError(str(e)) from None
    if not (adapter / "adapter_config.json").is_file():
        raise CliError(f"{adapter} has no adapter_config.json: pass the adapter/ folder of a zl-host run")
    try:
        base = base_model_path(program, manifest)
    except ModelDirError as e:
        raise CliError(str(e)) from None
    if base is None or not Path(base).exists():
        raise CliError(f"the base model {base} recorded in {program}/manifest.json is not on this machine")
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local: a missing file is an error, not a download
    from ..outputs.adapter_check import AdapterError, base_weights_present, check_adapter
    try:
        base_weights_present(Path(base))
        check_adapter(adapter, Path(base), manifest.get("lora"))
    except AdapterError as e:
        raise CliError(str(e)) from None
    from ..run.data import export_tokenizer, prepare_data

    _, held_out = split_held_out(prepare_data(program, manifest, data, training=False))
    base_weights = manifest["export"].get("base_weights", "fp32")  # exports before int8 have none
    from ..evaluation.progress import evaluate_both
    before, after = evaluate_both(base, adapter, held_out, base_weights, console)
    print(f"held-out answer tokens: {after['tokens']} (base weights {base_weights}, as trained)")
    print(f"base model:    NLL {before['nll']:.4f}  accuracy {before['accuracy']:.3f}")
    print(f"with adapter:  NLL {after['nll']:.4f}  accuracy {after['accuracy']:.3f}")
    result = {"base": before, "adapter": after}
    if generate > 0 or show > 0:
        result["generated"] = _generated(base, adapter, held_out, export_tokenizer(program, manifest),
                                         max(generate, show), show, base_weights, seed, max_new_tokens, console)
    return result


def _generated(base, adapter, held_out, tok, n, show, base_weights, seed, max_new_tokens, console) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..evaluation.generation import generate_both

    with Progress(TextColumn("eval: generating answers, base model and adapter"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("", total=None)
        gen = generate_both(base, adapter, held_out, tok, n, base_weights, max_new_tokens, seed,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    if not gen["n"]:
        return gen
    b, a = gen["base"], gen["adapter"]
    print(f"generated answers ({gen['decoding']}, {gen['n']} held-out rows, at most {gen['max_new_tokens']} tokens): "
          f"exact match {b['exact_match']:.3f} -> {a['exact_match']:.3f}, token F1 {b['f1']:.3f} -> {a['f1']:.3f} "
          "(base model -> with adapter)")
    if show > 0:
        rows = gen["rows"][:show]
        table = Table(title=f"{len(rows)} held-out prompts: the base model's answer and the adapter's ({gen['decoding']})")
        for col in ("prompt", "expected", "base model", "with adapter"):
            table.add_column(col, overflow="fold")
        for r in rows:
            table.add_row(r["prompt"][-200:], r["expected"], r["base"], r["adapter"])
        Console(soft_wrap=False).print(table)
    return gen
