"""Export every chunk of a model into a two-phase ExecuTorch training program.

Modes: "zerolock" (chunk_k.pte: local-loss training, the default) and "bp" (chunk_k_bp.pte:
a back-propagation pipeline stage for the GPipe / 1F1B / PipeDream baselines; same chunks,
same LoRA). Both kinds of program have methods phase1 and phase2, described in the manifest:
the ZeroLock ones in the chunk entry, the BP ones in its "bp" object (see zl_common.manifest.ChunkEntry.for_mode).

Writes into a temporary sibling directory and renames it into place at the end, so an
interrupted export never leaves something that looks complete."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from zl_common.hashing import sha256_file

from . import __version__, readout_lens
from .base_weights import quantize_base, stored_formats
from .chunk_jobs import default_jobs, run_chunk_jobs
from .chunk_model import (
    PROBE,
    PROBE_GRAD,
    BPChunkModel,
    ChunkModel,
    add_lora,
    bp_example_inputs,
    bp_input_names,
    example_inputs,
    input_names,
    peft_name,
)
from .chunk_spec import parse_chunk_spec
from .config import ExportConfig, readout_lens_layers, readout_problem, tail_depth
from .errors import ExportError, OutputDirError, VerifyError
from .gguf_model import load_gguf_tokenizer
from .lower import joint_program, lower_two_phase
from .lowering_cache import PreprocessCache
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, MODES, file_entry, ptd_contents, tensor_desc, write_manifest
from .model_source import (
    load_base_model,
    resolve_model,
    source_num_layers,
    weights_sha256,
    write_tiny_model_dir,
)
from .streamed_model import dir_config, read_model_dir
from .training_metadata import training_constant_methods
from .two_phase import split_at_marker

# chat_template.jinja: transformers 5 keeps an instruct model's template there, not in tokenizer_config.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")


@dataclass
class ChunkArtifacts:
    """What one chunk's export produced, kept in memory for --verify."""
    index: int
    first: int
    last: int
    chunk: ChunkModel | None  # None when the ZeroLock program was not exported
    entry: dict
    bp_chunk: BPChunkModel | None = None  # set when the BP program was exported


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
        remove_stale_partials(parent, out.name)
        # the pid in the name tells a later run whether the export that made it is still going
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the export is an ordinary folder
        return tmp
    except OSError as e:
        raise OutputDirError(f"cannot write into {parent} ({e.strerror}): choose a writable --out directory") from None


def remove_stale_partials(parent: Path, name: str) -> list[Path]:
    """Remove the temporary folders of exports to `name` that were killed before they could clean up
    (SIGKILL, a power cut): those whose process is gone, and unstamped ones of older versions."""
    removed = []
    for p in parent.glob(f".{name}.partial-*"):
        pid = p.name[len(f".{name}.partial-"):].split("-", 1)[0]
        if pid.isdigit() and pid != str(os.getpid()) and _alive(int(pid)):
            continue  # another export to the same place is running right now
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
                 model=None, modes=("zerolock",), eager_weights: bool = False,
                 verify=None, calibration: str | None = None,
                 lenses: dict | None = None, jobs: int | None = None) -> tuple[dict, list[ChunkArtifacts]]:
    """Run the whole export. `model` may be given directly (tests); otherwise `model_arg` is
    'tiny', 'smollm2', a GGUF file of a Llama or a HF Llama directory. `modes`: which programs to
    write, any of "zerolock", "bp". `eager_weights`: also write each chunk's frozen weights as
    chunk_k_weights.safetensors, for phones that run the chunk in eager PyTorch (zl-phone
    --backend eager). `cfg.readout == "lens"`: the lenses are fitted on `calibration` (a data spec as
    zl-host run --data takes; None: the synthetic set) through the export's tokenizer, unless
    `lenses` ({after_layer: (A, b)}) are given. `verify(dir, manifest, artifacts)`: checks the finished export before it is
    put in place (exporter/verify.py); if it raises VerifyError, `out` is left as it was and the
    export moves to `out`.failed-verify, without manifest.json (manifest.failed-verify.json), so
    nothing loads it as a good one. `jobs`: chunks exported at once, in forked worker processes (None: one per
    core, as memory allows; 1: one after another in this process; chunk_jobs). Returns (manifest,
    per-chunk artifacts)."""
    say = progress or (lambda msg: None)
    if readout_problem(cfg.readout):
        raise ExportError(readout_problem(cfg.readout))
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes}")
    modes = tuple(m for m in MODES if m in modes)
    tmp = prepare_out_dir(out)
    try:
        gguf_file = None
        if model is None:
            source, path = resolve_model(model_arg)
            parse_chunk_spec(chunks_spec, source_num_layers(source, path))  # before the slow load
        if model is None and source == "tiny":
            say("building the tiny 22-layer Llama")
            model_dir = write_tiny_model_dir(tmp / "model")
            model_ref = {"source": "tiny", "path": "model"}
        elif model is None and source in ("gguf", "smollm2"):
            say(f"loading {path} (GGUF, dequantized to fp32)")
            model_dir, gguf_file = None, path
            model = load_base_model(path)
            model_ref = {"source": source, "path": str(path)}
        elif model is None:
            model_dir = path
            model_ref = {"source": "hf_dir", "path": str(model_dir)}
        else:
            model_dir = None
            model_ref = {"source": "in-memory", "path": None}
        # a model directory is read further down, one layer at a time (streamed_model)
        hf_cfg = model.config if model is not None else dir_config(model_dir)
        ranges = parse_chunk_spec(chunks_spec, hf_cfg.num_hidden_layers)
        model_ref["weights_sha256"] = (weights_sha256(model_dir) if model_dir else
                                       sha256_file(gguf_file) if gguf_file else None)
        model_ref["config"] = {k: getattr(hf_cfg, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rms_norm_eps")}
        # the whole HF config: what the eager backend rebuilds the chunk's layers from
        model_ref["hf_config"] = json.loads(hf_cfg.to_json_string(use_diff=False))
        model_ref["hf_config"].pop("_name_or_path", None)  # where it was loaded from: "path" above
        if model_dir is not None:
            _copy_tokenizer(model_dir, tmp / "tokenizer")
        elif gguf_file is not None:  # the vocabulary and merges the file carries, as tokenizer.json
            load_gguf_tokenizer(gguf_file).save_pretrained(tmp / "tokenizer")

        lens_info = None
        if cfg.readout != "static" and "zerolock" not in modes:
            cfg = replace(cfg, readout="static")  # a BP stage reads out only at the end, through the final norm
        depth = tail_depth(cfg.readout, hf_cfg.num_hidden_layers)
        lens_layers = (readout_lens_layers(ranges, depth, hf_cfg.num_hidden_layers)
                       if cfg.readout != "static" else [])
        # lens, or tail:D with tails ending below the top: fitted on the fp32 model (as it is read)
        batches = _calibration_batches(tmp / "tokenizer", calibration, cfg) if lens_layers and lenses is None else None
        fit_after = lens_layers if batches else []
        if fit_after:
            say(f"readout lens: fitting {len(fit_after)} lenses on {calibration or 'the synthetic set'}")
        fitted, positions = {}, 0
        if model is None:
            say(f"reading {model_dir} one layer at a time" +
                (f", its frozen weights stored as {cfg.base_weights}" if cfg.base_weights != "fp32" else ""))
            model, fitted, positions = read_model_dir(model_dir, cfg.base_weights, cfg.decode_block_weights,
                                                      fit_after, batches, _layer_progress(say))
        elif fit_after:
            fitted, positions = readout_lens.fit_model_lenses(model, batches, fit_after, progress=_layer_progress(say))
        lenses, lens_info = (_readout_lenses(lens_layers, lenses, fitted, positions, calibration, tmp)
                             if lens_layers else (None, None))
        quantize_base(model, cfg.base_weights, cfg.decode_block_weights)  # a directory's is stored as read
        if cfg.base_weights != "fp32":
            say(f"frozen base weights stored as {cfg.base_weights}: {stored_formats(model)}")
        peft_model = add_lora(model, cfg)
        def export_chunk(k: int, say) -> dict:  # in a worker process when jobs > 1 (chunk_jobs)
            first, last = ranges[k]
            t0 = time.time()
            chunk = bp_chunk = None
            entry = {"index": k, "layers": [first, last]}
            if "zerolock" in modes:
                say(f"chunk {k}: layers {first}-{last}: tracing")
                chunk = ChunkModel(peft_model, first, last, cfg, lenses=lenses).eval()
                entry.update(_export_chunk(k, chunk, cfg, hf_cfg, tmp, say))
                if depth:
                    entry["readout_tail"] = _tail_record(chunk, hf_cfg.num_hidden_layers)
            if "bp" in modes:
                say(f"chunk {k}: layers {first}-{last}: tracing the BP stage")
                bp_chunk = BPChunkModel(peft_model, first, last, cfg, is_last=k == len(ranges) - 1).eval()
                entry["bp"] = _export_bp_chunk(k, bp_chunk, cfg, hf_cfg, tmp, say)
            entry.update(_write_lora_init(k, chunk or bp_chunk, tmp))
            if eager_weights:
                say(f"chunk {k}: writing the frozen weights for the eager backend")
                # the layers the readout tails run too (chunk.end_out: last, without a tail)
                entry["eager_weights"] = _write_eager_weights(k, peft_model.base_model.model, first,
                                                              chunk.end_out if chunk else last, tmp,
                                                              chunk.lens_tensors() if chunk else {})
            entry["export_seconds"] = round(time.time() - t0, 2)
            say(f"chunk {k}: done in {time.time() - t0:.1f} s")
            return entry

        if jobs is None:
            jobs = default_jobs(len(ranges), _largest_chunk_bytes(peft_model, ranges))
        if jobs > 1 and len(ranges) > 1:
            say(f"exporting {len(ranges)} chunks, {min(jobs, len(ranges))} at a time")
        entries = run_chunk_jobs(len(ranges), export_chunk, jobs, say)
        # the in-memory chunks verify compares against (cheap: views of the model's modules)
        results = [ChunkArtifacts(
            k, first, last,
            ChunkModel(peft_model, first, last, cfg, lenses=lenses).eval() if "zerolock" in modes else None,
            entry,
            BPChunkModel(peft_model, first, last, cfg, is_last=k == len(ranges) - 1).eval() if "bp" in modes else None)
            for k, ((first, last), entry) in enumerate(zip(ranges, entries))]

        manifest = export_manifest(tmp, model_ref, cfg, [r.entry for r in results], modes, lens_info)
        if verify is not None:
            try:
                manifest["verify"] = verify(tmp, manifest, results)
            except VerifyError as e:
                failed = _keep_failed(tmp, out, manifest, str(e))
                raise VerifyError(f"{e}; the export is kept in {failed} (not in {out})") from None
            write_manifest(tmp, manifest)
        commit_out_dir(tmp, out)
        return manifest, results
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_zerolock_chunk(k: int, chunk: ChunkModel, cfg: ExportConfig, hf_cfg, out_dir: Path, say=None) -> dict:
    """Chunk k's ZeroLock program (chunk_k.pte, its frozen weights chunk_k.ptd) and its LoRA
    initialisation written into `out_dir`, as export_model writes each chunk; returns the chunk's
    manifest entry (index, layers, program, weights, methods, lora_init, lora). For callers that build
    the ChunkModel themselves (a model already under LoRA, a subset of chunks: bench/export_tinyllama.py);
    export_manifest then describes the directory."""
    entry = {"index": k, "layers": [chunk.first, chunk.last]}
    entry.update(_export_chunk(k, chunk, cfg, hf_cfg, out_dir, say or (lambda msg: None)))
    entry.update(_write_lora_init(k, chunk, out_dir))
    return entry


def export_manifest(out_dir: Path, model_ref: dict, cfg: ExportConfig, chunks: list[dict], modes=("zerolock",),
                    lens_info: dict | None = None) -> dict:
    """manifest.json for the chunk entries written into `out_dir` (every file there listed with its
    sha256): `model_ref` says where the model came from ({"source", "path", "weights_sha256", "config", ...})."""
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "modes": list(modes),
        "model": model_ref,
        "export": cfg.to_json(),
        "lora": {"rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "scale": cfg.lora_scale,
                 "target_modules": list(cfg.target_modules),
                 "init": {"lora_A": "kaiming_uniform(a=sqrt(5)) (peft default)", "lora_B": "zeros",
                          "seed": cfg.seed}},
        "chunks": chunks,
        **({"readout_lens": lens_info} if lens_info else {}),
        "versions": versions(),
        "files": [file_entry(out_dir, p) for p in sorted(Path(out_dir).rglob("*")) if p.is_file()],
    }
    write_manifest(out_dir, manifest)
    return manifest


def _tail_record(chunk: ChunkModel, num_layers: int) -> dict:
    """The manifest's note of what a chunk's readout runs: its own h through layers
    out[0]..out[1], h_{k-1} through in[0]..in[1] (empty: none), each then read by "norm" or "lens"."""
    def side(a, end, lens):
        return {"layers": [a, end] if end >= a else [], "reads": "lens" if lens is not None else "norm",
                **({"lens_after": end} if lens is not None else {})}

    return {"out": side(chunk.last + 1, chunk.end_out, chunk.lens_out),
            "in": side(chunk.first, chunk.end_in, chunk.lens_in)}


def _largest_chunk_bytes(peft_model, ranges) -> int:
    """Bytes of the largest chunk's frozen layer weights (what sizes a worker's memory)."""
    layers = peft_model.base_model.model.model.layers
    size = [sum(t.numel() * t.element_size() for t in layers[i].state_dict().values()) for i in range(len(layers))]
    return max(sum(size[first:last + 1]) for first, last in ranges)


def _keep_failed(tmp: Path, out: Path, manifest: dict, error: str) -> Path:
    """Move an export that failed --verify aside, to `out`.failed-verify, its manifest renamed so
    that zl-host and phones refuse it; the files stay for a bug report."""
    failed = Path(out).absolute().with_name(Path(out).name + ".failed-verify")
    shutil.rmtree(failed, ignore_errors=True)
    (tmp / MANIFEST).unlink()
    write_manifest(tmp, {**manifest, "verify": {"passed": False, "error": error}})
    (tmp / MANIFEST).rename(tmp / "manifest.failed-verify.json")
    tmp.rename(failed)
    return failed


def _copy_tokenizer(model_dir: Path, dest: Path) -> None:
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    if files:
        dest.mkdir()
        for f in files:
            shutil.copy2(f, dest / f.name)


# XNNPACK partitions already lowered, shared by every chunk and program of the process's exports
# (the chunks are the same layers over again; lowering_cache)
_PREPROCESSED = PreprocessCache()


def _lower_and_write(split, cfg: ExportConfig, tmp: Path, stem: str, say, k: int, methods: dict) -> Path:
    """Lower both phases into tmp/{stem}.pte with frozen weights in tmp/{stem}.ptd, plus the
    metadata methods Android's TrainingModule reads (`methods`: the manifest's description)."""
    say(f"chunk {k}: lowering {stem} ({cfg.backend})")
    et = lower_two_phase(split, cfg.backend, stem, training_constant_methods(methods), cfg.xnnpack_ops,
                         quantized_base=cfg.base_weights != "fp32", cache=_PREPROCESSED)
    (tmp / f"{stem}.pte").write_bytes(et.buffer)
    et.write_tensor_data_to_file(str(tmp))
    ptd = tmp / f"{stem}.ptd"
    if not ptd.is_file():
        raise RuntimeError(f"ExecuTorch did not write the external weights file {ptd.name}")
    return ptd


def _describe(phase, rename: dict) -> dict:
    """A method's inputs and outputs with their shapes, from the traced graph; `rename` maps
    chunk-local names (LoRA, the BP probe) to the manifest's names."""
    ph = [n for n in phase.program.graph.nodes if n.op == "placeholder"]
    user = ph[len(ph) - len(phase.inputs):]
    outs = phase.program.graph.output_node().args[0]

    def out_name(nm):
        if not nm.startswith("grad:"):
            return nm
        t = nm[5:]
        return PROBE_GRAD if t == PROBE else "grad:" + rename[t]

    ins = [tensor_desc(rename.get(nm, nm), n.meta["val"]) for nm, n in zip(phase.inputs, user)]
    outd = [tensor_desc(out_name(nm), o.meta["val"]) for nm, o in zip(phase.outputs, outs)]
    return {"inputs": ins, "outputs": outd}


def _global_names(chunk: ChunkModel) -> dict:
    return {n: peft_name(n, chunk.first) for n in chunk.lora_parameters()}


def _write_lora_init(k: int, chunk: ChunkModel, tmp: Path) -> dict:
    """The LoRA initialisation (shared by the ZeroLock and BP programs: same modules)."""
    lora = chunk.lora_parameters()
    to_global = _global_names(chunk)
    init = tmp / f"chunk_{k}_lora_init.safetensors"
    save_file({to_global[n]: p.detach().contiguous() for n, p in lora.items()}, str(init))
    return {"lora_init": init.name, "lora": [tensor_desc(to_global[n], p) for n, p in lora.items()]}


EAGER_WEIGHTS_FORMAT = "zerolock-eager-weights"


def _write_eager_weights(k: int, base, first: int, last: int, tmp: Path, lens: dict) -> str:
    """chunk_k_weights.safetensors: the chunk's frozen weights under the Hugging Face model's own
    names (model.layers.first..last, the readout model.norm + lm_head, and model.embed_tokens for
    chunk 0) and its readout lenses (`lens`, readout_lens.to_tensors names), for the eager
    PyTorch backend, which cannot read ExecuTorch's .ptd."""
    keep = tuple(f"model.layers.{i}." for i in range(first, last + 1)) + ("model.norm.", "lm_head.")
    if first == 0:
        keep += ("model.embed_tokens.",)
    tensors = {}
    for name, t in base.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")  # peft's wrapper around a LoRA-targeted Linear
        if name.startswith(keep):
            tensors[name] = t.detach().contiguous().clone()  # clone: tied embeddings share storage
    tensors.update(lens)
    path = tmp / f"chunk_{k}_weights.safetensors"
    save_file(tensors, str(path), metadata={"format": EAGER_WEIGHTS_FORMAT, "layers": f"{first}-{last}"})
    return path.name


CALIBRATION_EXAMPLES = 256  # enough for the lens's d x d solve (SmolLM2: ~5,500 positions, ~20 s)


def _readout_lenses(after, given, fitted, positions, calibration, tmp: Path):
    """The lenses after the layers `after` (lens: every chunk boundary but the model's last;
    tail:D: where tails end below the top), `given` or `fitted`, written to
    readout_lens.safetensors; returns (lenses, the manifest's record of them)."""
    record = {"file": readout_lens.FILE, "after_layers": after}
    if given is None:
        lenses = fitted
        record.update(calibration=calibration or "synthetic", positions=positions, ridge=readout_lens.DEFAULT_RIDGE)
    else:
        lenses = given
        record["calibration"] = "given"
    missing = [i for i in after if i not in lenses]
    if missing:
        raise ExportError(f"no readout lens after layer {missing[0]}: the lenses must cover every chunk boundary "
                          "and every readout tail's end below the top")
    save_file(readout_lens.to_tensors({i: lenses[i] for i in after}), str(tmp / readout_lens.FILE))
    return lenses, record


def _layer_progress(say, every_s: float = 60.0):
    """progress(done, total) for a pass over the layers (reading them, fitting lenses): a line a
    quarter, and one a minute where layers are slow (a 3B model's lens fit: ~20 s a layer)."""
    t0 = last = time.time()

    def progress(done, total):
        nonlocal last
        if done == total or done % max(1, total // 4) == 0 or time.time() - last >= every_s:
            last = time.time()
            say(f"layers {done}/{total} ({last - t0:.0f} s)")
    return progress


def _calibration_batches(tok_dir: Path, calibration, cfg: ExportConfig) -> list:
    from transformers import AutoTokenizer

    from zl_common.data import DataError, load_examples, tokenized_microbatches

    if not tok_dir.is_dir():
        raise ExportError(f"--readout {cfg.readout} needs the model's tokenizer to read the lens's calibration text; "
                          "export from a model directory with tokenizer files, or use --readout static")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    try:
        examples = list(load_examples(calibration))[:CALIBRATION_EXAMPLES]
        batches = tokenized_microbatches(examples, tok, cfg.seq_len, 8)
    except DataError as e:
        raise ExportError(f"--calibration-data: {e}") from None
    if not batches:
        raise ExportError(f"--calibration-data {calibration} gave no text to fit the readout lens on")
    return batches


def _export_chunk(k: int, chunk: ChunkModel, cfg: ExportConfig, hf_cfg, tmp: Path, say) -> dict:
    inputs = example_inputs(chunk, cfg, hf_cfg.vocab_size, hf_cfg.hidden_size)
    names = input_names(chunk.is_first)
    split = split_at_marker(joint_program(chunk, inputs), names)
    rename = _global_names(chunk)
    methods = {"phase1": _describe(split.phase1, rename), "phase2": _describe(split.phase2, rename)}
    ptd = _lower_and_write(split, cfg, tmp, f"chunk_{k}", say, k, methods)
    return {
        "first_input": names[0], "program": f"chunk_{k}.pte", "weights": ptd.name, "methods": methods,
        "saved_activation_bytes": split.saved_bytes, "saved_activation_count": split.info["n_saved"],
    }


def _export_bp_chunk(k: int, chunk: BPChunkModel, cfg: ExportConfig, hf_cfg, tmp: Path, say) -> dict:
    """chunk_k_bp.pte: phase1 = BP forward (h_out + saved), phase2 = BP backward (grad_h_in and
    LoRA grads; the last stage also the global loss). Its frozen weights share chunk_k.ptd when
    that file holds every one of them under the same key with the same bytes."""
    inputs = bp_example_inputs(chunk, cfg, hf_cfg.vocab_size, hf_cfg.hidden_size)
    names = bp_input_names(chunk.is_first, chunk.is_last)
    split = split_at_marker(joint_program(chunk, inputs), names, ("loss",) if chunk.is_last else ())
    stem = f"chunk_{k}_bp"
    rename = _global_names(chunk)
    methods = {"phase1": _describe(split.phase1, rename), "phase2": _describe(split.phase2, rename)}
    ptd = _lower_and_write(split, cfg, tmp, stem, say, k, methods)
    shared = tmp / f"chunk_{k}.ptd"
    if shared.is_file() and _ptd_covers(shared, ptd):
        ptd.unlink()
        ptd = shared
    return {
        "first_input": names[0], "last": chunk.is_last, "program": f"{stem}.pte", "weights": ptd.name,
        "methods": methods,
        "saved_activation_bytes": split.saved_bytes, "saved_activation_count": split.info["n_saved"],
    }


def _ptd_covers(big: Path, small: Path) -> bool:
    """Every named tensor of `small` is in `big` under the same key, layout and bytes."""
    a, b = ptd_contents(big), ptd_contents(small)
    return all(key in a and a[key] == v for key, v in b.items())
