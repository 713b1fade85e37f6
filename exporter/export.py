"""Export every chunk of a model into a two-phase ExecuTorch training program.

Writes into a temporary sibling directory and renames it into place at the end, so an
interrupted export never leaves something that looks complete."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import __version__
from .chunk_model import ChunkModel, add_lora, example_inputs, input_names, peft_name
from .chunk_spec import parse_chunk_spec
from .config import ExportConfig
from .errors import OutputDirError
from .lower import joint_program, lower_two_phase
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, file_entry, tensor_desc, write_manifest
from .model_source import load_model_dir, weights_sha256, write_tiny_model_dir
from .two_phase import split_at_marker

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


@dataclass
class ChunkArtifacts:
    """What one chunk's export produced, kept in memory for --verify."""
    index: int
    first: int
    last: int
    chunk: ChunkModel
    entry: dict


def versions() -> dict:
    import executorch
    import peft
    import transformers

    try:
        et_version = executorch.version.__version__
    except AttributeError:
        from importlib.metadata import version
        et_version = version("executorch")
    return {"zerolock": __version__, "torch": torch.__version__, "executorch": et_version,
            "transformers": transformers.__version__, "peft": peft.__version__}


def prepare_out_dir(out: Path) -> Path:
    """Check the output location up front; return a fresh temporary dir beside it."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output path {out} is a file: give a directory path with --out")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise OutputDirError(f"output dir {out} is not empty and holds no previous export: give an empty or new directory")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the export is an ordinary folder
        return tmp
    except OSError as e:
        raise OutputDirError(f"cannot write into {parent} ({e.strerror}): choose a writable --out directory") from None


def commit_out_dir(tmp: Path, out: Path) -> None:
    """Atomically put the finished export in place (replacing an older export)."""
    out = Path(out).absolute()
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_model(model_arg: str, chunks_spec: str, out: Path, cfg: ExportConfig, progress=None,
                 model=None) -> tuple[dict, list[ChunkArtifacts]]:
    """Run the whole export. `model` may be given directly (tests); otherwise `model_arg` is
    'tiny' or a HF Llama directory. Returns (manifest, per-chunk artifacts)."""
    say = progress or (lambda msg: None)
    tmp = prepare_out_dir(out)
    try:
        if model is None and model_arg == "tiny":
            say("building the tiny 22-layer Llama")
            model_dir = write_tiny_model_dir(tmp / "model")
            model = load_model_dir(model_dir)
            model_ref = {"source": "tiny", "path": "model"}
        elif model is None:
            model_dir = Path(model_arg).absolute()
            say(f"loading {model_dir}")
            model = load_model_dir(model_dir)
            model_ref = {"source": "hf_dir", "path": str(model_dir)}
        else:
            model_dir = None
            model_ref = {"source": "in-memory", "path": None}
        hf_cfg = model.config
        ranges = parse_chunk_spec(chunks_spec, hf_cfg.num_hidden_layers)
        model_ref["weights_sha256"] = weights_sha256(model_dir) if model_dir else None
        model_ref["config"] = {k: getattr(hf_cfg, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rms_norm_eps")}
        if model_dir is not None:
            _copy_tokenizer(model_dir, tmp / "tokenizer")

        peft_model = add_lora(model, cfg)
        results = []
        for k, (first, last) in enumerate(ranges):
            t0 = time.time()
            say(f"chunk {k}: layers {first}-{last}: tracing")
            chunk = ChunkModel(peft_model, first, last, cfg).eval()
            results.append(_export_chunk(k, chunk, cfg, hf_cfg, tmp, say))
            results[-1].entry["export_seconds"] = round(time.time() - t0, 2)
            say(f"chunk {k}: done in {time.time() - t0:.1f} s")

        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model": model_ref,
            "export": cfg.to_json(),
            "lora": {"rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "scale": cfg.lora_scale,
                     "target_modules": list(cfg.target_modules),
                     "init": {"lora_A": "kaiming_uniform(a=sqrt(5)) (peft default)", "lora_B": "zeros",
                              "seed": cfg.seed}},
            "chunks": [r.entry for r in results],
            "versions": versions(),
            "files": [file_entry(tmp, p) for p in sorted(tmp.rglob("*")) if p.is_file()],
        }
        write_manifest(tmp, manifest)
        commit_out_dir(tmp, out)
        return manifest, results
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy_tokenizer(model_dir: Path, dest: Path) -> None:
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    if files:
        dest.mkdir()
        for f in files:
            shutil.copy2(f, dest / f.name)


def _export_chunk(k: int, chunk: ChunkModel, cfg: ExportConfig, hf_cfg, tmp: Path, say) -> ChunkArtifacts:
    inputs = example_inputs(chunk, cfg, hf_cfg.vocab_size, hf_cfg.hidden_size)
    names = input_names(chunk.is_first)
    ep = joint_program(chunk, inputs)
    split = split_at_marker(ep, names)
    say(f"chunk {k}: lowering ({cfg.backend})")
    tag = f"chunk_{k}"
    et = lower_two_phase(split, cfg.backend, tag)

    pte = tmp / f"chunk_{k}.pte"
    pte.write_bytes(et.buffer)
    et.write_tensor_data_to_file(str(tmp))
    ptd = tmp / f"{tag}.ptd"
    if not ptd.is_file():
        raise RuntimeError(f"ExecuTorch did not write the external weights file {ptd.name}")

    lora = chunk.lora_parameters()
    to_global = {n: peft_name(n, chunk.first) for n in lora}
    init = tmp / f"chunk_{k}_lora_init.safetensors"
    save_file({to_global[n]: p.detach().contiguous() for n, p in lora.items()}, str(init))

    # Describe both methods' inputs and outputs with their shapes, from the traced graphs.
    def describe(phase):
        ph = [n for n in phase.program.graph.nodes if n.op == "placeholder"]
        user = ph[len(ph) - len(phase.inputs):]
        outs = phase.program.graph.output_node().args[0]
        ins = [tensor_desc(to_global.get(nm, nm), n.meta["val"]) for nm, n in zip(phase.inputs, user)]
        outd = [tensor_desc(_global_out(nm, to_global), o.meta["val"]) for nm, o in zip(phase.outputs, outs)]
        return {"inputs": ins, "outputs": outd}

    entry = {
        "index": k, "layers": [chunk.first, chunk.last], "first_input": names[0],
        "program": f"chunk_{k}.pte", "weights": ptd.name, "lora_init": init.name,
        "lora": [tensor_desc(to_global[n], p) for n, p in lora.items()],
        "methods": {"phase1": describe(split.phase1), "phase2": describe(split.phase2)},
        "saved_activation_bytes": split.saved_bytes, "saved_activation_count": split.info["n_saved"],
    }
    return ChunkArtifacts(k, chunk.first, chunk.last, chunk, entry)


def _global_out(name: str, to_global: dict) -> str:
    return "grad:" + to_global[name[5:]] if name.startswith("grad:") else name
