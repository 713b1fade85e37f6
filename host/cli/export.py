"""zl-host export RUN --gguf / --merged: a run's adapter where users run their models.

--gguf    RUN/export/adapter.gguf, a llama.cpp LoRA adapter (llama-cli -m BASE.gguf --lora
          adapter.gguf), and, for a GGUF base, RUN/export/Modelfile for Ollama (FROM + ADAPTER)
--merged  RUN/export/merged/ (HF safetensors, base + LoRA folded in) and RUN/export/merged.gguf"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .error import CliError


def add_parser(sub) -> None:
    x = sub.add_parser("export", help="the run's adapter as a GGUF LoRA adapter (llama.cpp, Ollama) and/or a merged model",
                       description=__doc__.split("\n", 1)[1])
    x.add_argument("run", metavar="RUN", help="a zl-host run directory (its adapter/ and run.json)")
    x.add_argument("--gguf", action="store_true", help="write adapter.gguf (llama.cpp --lora, Ollama ADAPTER)")
    x.add_argument("--merged", action="store_true", help="write merged/ (HF safetensors) and merged.gguf (f16)")
    x.add_argument("--out", default=None, help="output dir (default RUN/export)")
    x.set_defaults(func=cmd_export)


def resolve_run(run: Path) -> tuple[Path, Path, dict, Path]:
    """(adapter dir, program dir, manifest, base model path) of a run directory, or CliError."""
    from exporter.errors import ModelDirError
    from exporter.manifest import ManifestError, load_manifest

    from ..outputs.adapter import base_model_path

    adapter = run / "adapter"
    if not (run / "run.json").is_file() or not (adapter / "adapter_config.json").is_file():
        raise CliError(f"{run} is not a finished zl-host run (it needs run.json and adapter/adapter_config.json): "
                       "pass the --out directory of a zl-host run that completed")
    try:
        program = Path(json.loads((run / "run.json").read_text())["program"])
        manifest = load_manifest(program, check_files=False)
        base = base_model_path(program, manifest)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise CliError(f"{run / 'run.json'} is unreadable ({e}): pass the --out directory of a zl-host run") from None
    except (ManifestError, ModelDirError) as e:
        raise CliError(str(e)) from None
    if base is None or not Path(base).exists():
        raise CliError(f"the base model {base} recorded in {program}/manifest.json is not on this machine: "
                       "restore it where the export found it")
    return adapter, program, manifest, Path(base)


def cmd_export(a) -> int:
    from rich.console import Console

    from ..outputs.adapter_check import AdapterError

    say = Console(stderr=True, soft_wrap=True).print
    if not (a.gguf or a.merged):
        raise CliError("say what to write: --gguf (a llama.cpp/Ollama LoRA adapter), --merged (base + LoRA), or both")
    run = Path(a.run)
    adapter, program, manifest, base = resolve_run(run)
    out = Path(a.out) if a.out else run / "export"
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local: a missing file is an error, not a download
    lora = manifest.get("lora")
    try:
        if a.gguf:
            from ..outputs.gguf_adapter import write_gguf_adapter

            path = write_gguf_adapter(adapter, base, out / "adapter.gguf", lora, name=f"{run.name} LoRA")
            print(f"GGUF LoRA adapter: {path}")
            if base.is_file():
                (out / "Modelfile").write_text(f"FROM {base}\nADAPTER {path.absolute()}\n")
                print(f"  llama.cpp: llama-cli -m {base} --lora {path}")
                print(f"  Ollama:    ollama create {run.name.lower()} -f {out / 'Modelfile'}  (FROM the base, ADAPTER this file)")
            else:
                print(f"  llama.cpp: llama-cli -m BASE.gguf --lora {path}  (BASE.gguf: {base} converted with llama.cpp's "
                      "convert_hf_to_gguf.py)")
            if manifest["export"].get("base_weights", "fp32") != "fp32":
                print(f"  note: the phones trained on a {manifest['export']['base_weights']} base; llama.cpp applies the "
                      "adapter to the base file as it is")
        if a.merged:
            from ..outputs.merged_model import merged_model, write_merged_gguf, write_merged_hf

            say("merging the LoRA into the base model ...", markup=False)
            model = merged_model(adapter, base, lora)
            hf = write_merged_hf(model, program / "tokenizer", out / "merged")
            print(f"merged model (HF safetensors, fp32): {hf}")
            try:
                g = write_merged_gguf(model, base, program / "tokenizer", out / "merged.gguf")
                print(f"merged model (GGUF, {'f16' if base.is_file() else 'f32'}): {g}   llama-cli -m {g}")
            except AdapterError as e:
                say(f"zl-host: merged.gguf not written: {e}", style="yellow", markup=False)
    except AdapterError as e:
        raise CliError(str(e)) from None
    return 0
