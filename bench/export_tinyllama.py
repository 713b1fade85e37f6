"""Benchmark zl-export on TinyLlama-1.1B shapes (random init).

hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocab 32000; chunks 0-6,7-13,14-21;
B=1, S=128. For every exported chunk it prints, in one run:
  * export time and file sizes (.pte program, .ptd frozen weights, LoRA init);
  * median phase 1 / phase 2 step time in ExecuTorch against the same chunk's eager PyTorch
    forward + loss.backward() on the same CPU and thread count (torch and the ExecuTorch
    threadpool both set to --threads), steps alternating in one process, and the ratio
    (target <= 1.5x);
  * the peak memory (VmHWM / ru_maxrss, and PSS from smaps_rollup) of a fresh process that
    loads that one chunk and runs steps, against the floor = .ptd size + saved activations + h_k
    (target <= 1.25x), raw and net of the RSS of a process that has only imported the runtime;
  * with --profile, an ETDump per-operator profile of one warm step (delegated vs portable).
Results go to bench/results/export_tinyllama.json (merged by chunk/settings across runs) and to
the "## Export (zl-export)" section of docs/BENCHMARKS.md.

  python bench/export_tinyllama.py --only-chunk 1                  # export + measure chunk 1
  python bench/export_tinyllama.py --loss-positions 128,16         # all chunks, both readout sizes
  python bench/export_tinyllama.py --skip-export /tmp/zl_bench/lp128 --only-chunk 1 --profile
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    REPO,
    machine,
    median,
    memory_snapshot,
    mib,
    now_iso,
    proc_status,
    replace_md_section,
    run_sampled,
)

from zl_mobile.telemetry import take_peak_rss_bytes  # noqa: E402

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
# A much smaller model with the same layer count, for a quick check of this script.
SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=22, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256)
CONFIGS = {"tinyllama": TINYLLAMA, "smoke": SMOKE}
MODEL_SEED = 0
TIME_TARGET = 1.5
MEM_TARGET = 1.25
PSS_INTERVAL_S = 0.05
RESULTS = REPO / "bench" / "results" / "export_tinyllama.json"
DOC = REPO / "docs" / "BENCHMARKS.md"
HEADING = "## Export (zl-export)"
FINDINGS = "### Findings"


# --------------------------------------------------------------------------------------------
# worker: a fresh process that only imports the runtime, or loads one chunk and runs steps
# --------------------------------------------------------------------------------------------

def _runtime_imports():
    """Everything a device-side process imports to run a chunk (the baseline process too)."""
    from exporter.chunk_model import example_inputs, input_names
    from exporter.config import ExportConfig
    from exporter.verify import sample_lora
    from zl_common.et_runtime import runtime
    from zl_common.program import ChunkProgram
    return runtime(), example_inputs, input_names, ExportConfig, sample_lora, ChunkProgram


def _batch(manifest, entry):
    _, example_inputs, input_names, ExportConfig, _, _ = _runtime_imports()
    e = manifest["export"]
    cfg = ExportConfig(seq_len=e["seq_len"], micro_batch=e["micro_batch"], loss_positions=e["loss_positions"])
    mc = manifest["model"]["config"]

    class Stub:  # example_inputs only asks whether the chunk owns the embedding
        is_first = entry["layers"][0] == 0

    inputs = example_inputs(Stub, cfg, mc["vocab_size"], mc["hidden_size"], seed=1)
    return inputs, dict(zip(input_names(Stub.is_first), inputs))


def set_lora(chunk, lora: dict) -> dict:
    """Load the manifest-named LoRA values into the eager chunk; returns its LoRA parameters."""
    import torch

    from exporter.chunk_model import peft_name

    params = chunk.lora_parameters()
    to_local = {peft_name(n, chunk.first): n for n in params}
    with torch.no_grad():
        for g, v in lora.items():
            params[to_local[g]].copy_(v)
    return params


def timed_eager_step(chunk, inputs, params: dict) -> tuple[float, float, float]:
    """One eager forward + loss.backward() from cleared gradients: (forward s, backward s, loss)."""
    for p in params.values():
        p.grad = None
    t0 = time.perf_counter()
    loss = chunk(*inputs)[0]
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1, loss.item()


def eager_worker(a) -> dict:
    """The chunk's eager forward + backward alone in a process (no ExecuTorch runtime loaded), as
    the ExecuTorch steps run alone in the "run" worker: the two runtimes' thread pools slow each
    other down when they share a process (measured: see docs/BENCHMARKS.md)."""
    import torch

    from exporter.chunk_model import ChunkModel, add_lora, example_inputs
    from exporter.config import ExportConfig
    from exporter.verify import sample_lora

    torch.set_num_threads(a.threads)
    manifest = json.loads((Path(a.dir) / "manifest.json").read_text())
    entry = next(c for c in manifest["chunks"] if c["index"] == a.chunk)
    e, mc = manifest["export"], manifest["model"]["config"]
    cfg = ExportConfig(seq_len=e["seq_len"], micro_batch=e["micro_batch"], loss_positions=e["loss_positions"])
    chunk = ChunkModel(add_lora(build_model(a.config), ExportConfig()), *entry["layers"], cfg).eval()
    params = set_lora(chunk, sample_lora(entry, 0))
    inputs = example_inputs(chunk, cfg, mc["vocab_size"], mc["hidden_size"], seed=1)  # as _batch
    fw, bw = [], []
    for i in range(a.warmup + a.steps):
        f, b, loss = timed_eager_step(chunk, inputs, params)
        if i >= a.warmup:
            fw.append(f)
            bw.append(b)
    return {"forward_s": fw, "backward_s": bw, "loss": loss, "threads_torch": torch.get_num_threads()}


def worker(a) -> dict:
    if a.worker == "eager":
        return eager_worker(a)
    import torch
    rt, _, _, _, sample_lora, ChunkProgram = _runtime_imports()
    torch.set_num_threads(a.threads)
    rt._unsafe_reset_threadpool(a.threads)
    out = {"threads_torch": torch.get_num_threads(),
           "threads_executorch": rt._threadpool_get_thread_count()}
    gc.collect()
    out["after_import"] = memory_snapshot()
    if a.worker == "baseline":
        return out

    manifest = json.loads((Path(a.dir) / "manifest.json").read_text())
    entry = next(c for c in manifest["chunks"] if c["index"] == a.chunk)
    _, batch = _batch(manifest, entry)
    lora = sample_lora(entry, 0)

    if a.worker == "profile":
        return out | profile(a, manifest, entry, batch, lora)

    t0 = time.perf_counter()
    prog = ChunkProgram(Path(a.dir), entry, in_place=True)  # as the stage runs it (ZeroLock)
    out["load_s"] = time.perf_counter() - t0
    out["after_load"] = memory_snapshot()
    p1, p2, mem_mid = [], [], None
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        h, saved = prog.phase1(lora, batch)
        t1 = time.perf_counter()
        res = prog.phase2(lora, saved, batch)
        t2 = time.perf_counter()
        if i == a.warmup + a.steps - 1:
            mem_mid = memory_snapshot()  # saved activations and gradients still alive
        if i >= a.warmup:
            p1.append(t1 - t0)
            p2.append(t2 - t1)
        del h, saved
    out |= {"phase1_s": p1, "phase2_s": p2, "loss": res.loss, "task_loss": res.task_loss,
            "consis_loss": res.consis_loss, "after_step": mem_mid, "end": memory_snapshot()}
    return out


def profile(a, manifest, entry, batch, lora) -> dict:
    """One step with ETDump on: time per operator (delegated XNNPACK blocks vs portable kernels)."""
    from zl_common.program import ChunkProgram

    prog = ChunkProgram(Path(a.dir), entry, in_place=True, etdump=True)
    for _ in range(2):  # the first step warms up (XNNPACK weight packing etc.); both are recorded
        h, saved = prog.phase1(lora, batch)
        prog.phase2(lora, saved, batch)
    etdump = Path(a.profile_out)
    prog.write_etdump(etdump)
    from executorch.devtools import Inspector

    insp = Inspector(etdump_path=str(etdump))
    rows, totals = {}, {}
    execs = [b for b in insp.event_blocks if b.name == "Execute"]  # in first-run order: phase1, phase2
    for method, block in zip(("phase1", "phase2"), execs):
        for ev in block.events:
            if not ev.perf_data or not ev.perf_data.raw:
                continue
            ms = ev.perf_data.raw[-1]  # the second (warm) run
            if ev.name in ("Method::execute", "OPERATOR_CALL", "DELEGATE_CALL"):
                totals[f"{method}:{ev.name}"] = totals.get(f"{method}:{ev.name}", 0.0) + ms
                continue
            key = (method, ev.name)
            rows.setdefault(key, []).append(ms)
    per_op = [{"block": b, "op": n, "calls": len(v), "ms": sum(v)} for (b, n), v in rows.items()]
    per_op.sort(key=lambda r: -r["ms"])
    return {"profile": per_op, "profile_totals_ms": totals}


# --------------------------------------------------------------------------------------------
# static view of a .pte: which operators run outside the delegate
# --------------------------------------------------------------------------------------------

def pte_ops(pte: Path) -> dict:
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import DelegateCall, KernelCall

    prog = deserialize_pte_binary(pte.read_bytes())
    prog = getattr(prog, "program", prog)
    res = {}
    for plan in prog.execution_plan:
        kernels, delegates = {}, 0
        for chain in plan.chains:
            for ins in chain.instructions:
                arg = ins.instr_args
                if isinstance(arg, KernelCall):
                    op = plan.operators[arg.op_index]
                    name = op.name + (f".{op.overload}" if op.overload else "")
                    kernels[name] = kernels.get(name, 0) + 1
                elif isinstance(arg, DelegateCall):
                    delegates += 1
        res[plan.name] = {"delegate_calls": delegates, "kernel_calls": sum(kernels.values()),
                          "planned_bytes": int(sum(plan.non_const_buffer_sizes)),
                          "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}
    return res


# --------------------------------------------------------------------------------------------
# export and eager (main process: holds the whole model)
# --------------------------------------------------------------------------------------------

def build_model(config_name: str):
    import torch
    from transformers import LlamaForCausalLM

    from exporter.model_source import llama_config
    torch.manual_seed(MODEL_SEED)
    return LlamaForCausalLM(llama_config(**CONFIGS[config_name])).eval()


def export_chunks(peft_model, hf_cfg, ranges, indices, cfg, out: Path, say) -> dict:
    """export_model() for a subset of chunks, on an already LoRA-wrapped model (so several
    readout sizes can share one model): zl-export's own per-chunk path (export_zerolock_chunk) and
    manifest (export_manifest), with this bench's memory readings in each chunk's entry."""
    from exporter.chunk_model import ChunkModel
    from exporter.export import commit_out_dir, export_manifest, export_zerolock_chunk, prepare_out_dir

    tmp = prepare_out_dir(out)
    chunks, artifacts = [], {}
    try:
        for k in indices:
            first, last = ranges[k]
            gc.collect()
            take_peak_rss_bytes()  # VmHWM from here on is this chunk's export peak
            rss0 = proc_status()["VmRSS"]
            t0 = time.time()
            say(f"chunk {k}: layers {first}-{last}: tracing + lowering ({cfg.backend})")
            chunk = ChunkModel(peft_model, first, last, cfg).eval()
            art = SimpleNamespace(entry=export_zerolock_chunk(k, chunk, cfg, hf_cfg, tmp, say), chunk=chunk)
            art.entry["export_seconds"] = round(time.time() - t0, 2)
            st = proc_status()
            art.entry["bench_export_peak_rss"] = st["VmHWM"]
            art.entry["bench_export_peak_extra"] = st["VmHWM"] - rss0
            say(f"chunk {k}: exported in {time.time() - t0:.1f} s, peak RSS {mib(st['VmHWM'])} "
                f"(+{mib(st['VmHWM'] - rss0)} over the loaded model)")
            chunks.append(art.entry)
            artifacts[k] = art
            gc.collect()
        model_ref = {"source": "in-memory", "path": None, "weights_sha256": None,
                     "config": {k: getattr(hf_cfg, k) for k in (
                         "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "vocab_size", "rms_norm_eps")},
                     "bench_random_init_seed": MODEL_SEED}
        manifest = export_manifest(tmp, model_ref, cfg, chunks)
        commit_out_dir(tmp, out)
    except BaseException:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest, artifacts


def interleaved_times(chunk, manifest, entry, export_dir: Path, steps: int, warmup: int, threads: int) -> dict:
    """Eager forward+backward and ExecuTorch phase1+phase2 on the same batch and LoRA values,
    alternating step by step in this process, so that load from other processes on the machine
    hits both alike."""
    import torch

    from exporter.chunk_model import peft_name
    from exporter.verify import sample_lora
    from zl_common.et_runtime import runtime
    from zl_common.program import ChunkProgram

    torch.set_num_threads(threads)
    runtime()._unsafe_reset_threadpool(threads)
    inputs, batch = _batch(manifest, entry)
    lora = sample_lora(entry, 0)
    params = set_lora(chunk, lora)
    to_local = {peft_name(n, chunk.first): n for n in params}
    prog = ChunkProgram(export_dir, entry, in_place=True)
    fw, bw, p1, p2 = [], [], [], []
    for i in range(warmup + steps):
        f, b, loss = timed_eager_step(chunk, inputs, params)
        t2 = time.perf_counter()
        h_et, saved = prog.phase1(lora, batch)
        t3 = time.perf_counter()
        res = prog.phase2(lora, saved, batch)
        t4 = time.perf_counter()
        del h_et, saved
        if i >= warmup:
            fw.append(f)
            bw.append(b)
            p1.append(t3 - t2)
            p2.append(t4 - t3)
    grads_e = {g: params[to_local[g]].grad for g in lora}
    rel = max(((res.grads[g] - grads_e[g]).abs().max() / grads_e[g].abs().max().clamp(min=1e-12)).item()
              for g in lora)
    for p in params.values():
        p.grad = None
    del prog
    return {"forward_s": fw, "backward_s": bw, "loss": loss, "et_phase1_s": p1, "et_phase2_s": p2,
            "et_loss": res.loss, "max_rel_grad_diff": rel}


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------

def run_worker(mode: str, a, export_dir: Path, chunk: int) -> dict:
    res_file = Path(export_dir) / f".bench_{mode}_{chunk}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--dir", str(export_dir),
           "--chunk", str(chunk), "--threads", str(a.threads), "--config", a.config,
           "--steps", str(max(a.mem_steps, a.steps) if mode == "run" else a.steps),
           "--warmup", str(a.warmup), "--result", str(res_file),
           "--profile-out", str(Path(export_dir) / f"chunk_{chunk}.etdump")]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONWARNINGS="ignore")
    # PSS sampled from outside every 50 ms: its peak is the memory the process really held (RSS
    # counts the .ptd twice: each method maps it); sparse, so the timed steps barely notice it
    rc, err, samples = run_sampled(cmd, PSS_INTERVAL_S, env=env)
    if rc != 0:
        raise RuntimeError(f"worker {mode} for chunk {chunk} failed ({rc}):\n{err}")
    res = json.loads(res_file.read_text())
    res_file.unlink()
    res["pss_peak_sampled"] = max((pss for _, pss in samples), default=None)
    return res


def step_s(res: dict, first: str, second: str) -> float:
    return median([x + y for x, y in zip(res[first], res[second])])


def summarize(manifest, entry, export_dir: Path, eager, rounds, base, ops, a, lp) -> dict:
    """`rounds`: [(ExecuTorch-alone worker result, eager-alone worker result or None)], run in
    turn, so that a drift of the machine's speed hits both runtimes alike; the step-time ratio is
    the median of the rounds' ratios, memory the largest peak over the rounds."""
    d = Path(export_dir)
    mc = manifest["model"]["config"]
    e = manifest["export"]
    h_bytes = e["micro_batch"] * e["seq_len"] * mc["hidden_size"] * 4
    ptd = (d / entry["weights"]).stat().st_size
    floor = ptd + entry["saved_activation_bytes"] + h_bytes
    et, eager_alone = rounds[0]
    # interleaved with eager in the main process; without eager, the first ExecuTorch-alone worker's
    src = eager if eager else {"et_phase1_s": et["phase1_s"], "et_phase2_s": et["phase2_s"]}
    p1, p2 = median(src["et_phase1_s"]), median(src["et_phase2_s"])
    et_step = step_s(src, "et_phase1_s", "et_phase2_s")
    fw, bw = (median(eager["forward_s"]), median(eager["backward_s"])) if eager else (None, None)
    eager_step = step_s(eager, "forward_s", "backward_s") if eager else None
    # the verdict: each runtime alone in its own process, as a phone runs only ExecuTorch
    et_steps = [step_s(r, "phase1_s", "phase2_s") for r, _ in rounds]
    eager_steps = [step_s(r, "forward_s", "backward_s") for _, r in rounds if r]
    round_ratios = [x / y for x, y in zip(et_steps, eager_steps)]
    w_step, alone = median(et_steps), (median(eager_steps) if eager_steps else None)
    ratio = median(round_ratios) if round_ratios else None
    peak = max(r["end"]["hwm"] for r, _ in rounds)
    base_rss = base["after_import"]["rss"]
    peak_pss, base_pss = max(r["pss_peak_sampled"] for r, _ in rounds), base["after_import"]["pss"]
    return {
        "key": f"{a.config}/{e['backend']}/lp{lp}/chunk{entry['index']}",
        "config": a.config, "chunk": entry["index"], "layers": entry["layers"], "backend": e["backend"],
        "micro_batch": e["micro_batch"], "seq_len": e["seq_len"], "loss_positions": lp,
        "threads": a.threads, "steps": a.steps, "warmup": a.warmup, "mem_steps": max(a.mem_steps, a.steps), "export_dir": str(d),
        "export_s": entry.get("export_seconds"), "export_peak_rss": entry.get("bench_export_peak_rss"),
        "export_peak_extra": entry.get("bench_export_peak_extra"),
        "pte_bytes": (d / entry["program"]).stat().st_size, "ptd_bytes": ptd,
        "lora_init_bytes": (d / entry["lora_init"]).stat().st_size,
        "saved_activation_bytes": entry["saved_activation_bytes"],
        "saved_activation_count": entry["saved_activation_count"], "h_bytes": h_bytes,
        "et_phase1_s": p1, "et_phase2_s": p2, "et_step_s": et_step,
        "eager_forward_s": fw, "eager_backward_s": bw, "eager_step_s": eager_step,
        "time_ratio_interleaved": et_step / eager_step if eager_step else None,
        "eager_step_s_fresh_process": alone,
        "eager_forward_s_fresh_process": eager_alone and median(eager_alone["forward_s"]),
        "eager_backward_s_fresh_process": eager_alone and median(eager_alone["backward_s"]),
        "time_ratio": ratio, "time_ok": (ratio <= TIME_TARGET) if ratio else None,
        "rounds": len(rounds), "round_ratios": round_ratios, "round_et_step_s": et_steps,
        "round_eager_step_s": eager_steps,
        "et_step_s_fresh_process": w_step, "et_phase1_s_fresh_process": median(et["phase1_s"]),
        "et_phase2_s_fresh_process": median(et["phase2_s"]),
        "raw_times_s": {"eager_forward": eager and eager["forward_s"], "eager_backward": eager and eager["backward_s"],
                        "et_phase1": src["et_phase1_s"], "et_phase2": src["et_phase2_s"],
                        "et_phase1_fresh_process": et["phase1_s"], "et_phase2_fresh_process": et["phase2_s"],
                        "eager_forward_fresh_process": eager_alone and eager_alone["forward_s"],
                        "eager_backward_fresh_process": eager_alone and eager_alone["backward_s"]},
        "loss_et": et["loss"], "loss_eager": eager["loss"] if eager else None,
        "max_rel_grad_diff": eager and eager["max_rel_grad_diff"], "loadavg": eager and eager.get("loadavg"),
        "load_s": et["load_s"],
        "floor_bytes": floor, "peak_rss": peak, "peak_ru_maxrss": et["end"]["ru_maxrss"],
        "rss_after_load": et["after_load"]["rss"], "rss_anon_peak_step": et["after_step"]["rss_anon"],
        "rss_file_peak_step": et["after_step"]["rss_file"],
        "pss_after_step": et["after_step"]["pss"], "baseline_rss": base_rss,
        "baseline_pss": base["after_import"]["pss"],
        "mem_ratio_raw": peak / floor, "mem_ratio_net": (peak - base_rss) / floor,
        "mem_ok_raw": peak / floor <= MEM_TARGET, "mem_ok_net": (peak - base_rss) / floor <= MEM_TARGET,
        # the verdict: peak PSS, physical memory counted once
        "peak_pss": peak_pss, "mem_ratio_pss": peak_pss / floor, "mem_ratio_pss_net": (peak_pss - base_pss) / floor,
        "mem_ok": peak_pss / floor <= MEM_TARGET, "mem_ok_net_pss": (peak_pss - base_pss) / floor <= MEM_TARGET,
        "threads_executorch": et["threads_executorch"], "threads_torch": et["threads_torch"],
        "pte_ops": ops,
    }


def print_tables(rows, console):
    from rich.table import Table

    t = Table(title="zl-export on TinyLlama-1.1B shapes: export", show_lines=False)
    for c in ("chunk", "layers", "N", "export", "export peak RSS", ".pte", ".ptd", "saved acts"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["chunk"]), "-".join(map(str, r["layers"])), str(r["loss_positions"]),
                  f"{r['export_s']:.0f} s" if r["export_s"] else "-", mib(r["export_peak_rss"]),
                  mib(r["pte_bytes"]), mib(r["ptd_bytes"]),
                  f"{mib(r['saved_activation_bytes'])} ({r['saved_activation_count']})")
    console.print(t)
    t = Table(title=f"step time (median, {rows[0]['threads']} threads): ExecuTorch vs eager PyTorch "
                    f"(target <= {TIME_TARGET}x)")
    for c in ("chunk", "N", "ET phase1", "ET phase2", "ET step", "eager step", "ratio", "target",
              "interleaved ET / eager", "ratio"):
        t.add_column(c, justify="right")
    for r in rows:
        ok = r["time_ok"]
        t.add_row(str(r["chunk"]), str(r["loss_positions"]), fmt_ms(r["et_phase1_s_fresh_process"]),
                  fmt_ms(r["et_phase2_s_fresh_process"]), fmt_ms(r["et_step_s_fresh_process"]),
                  fmt_ms(r["eager_step_s_fresh_process"]),
                  fmt_x(r["time_ratio"]),
                  "-" if ok is None else ("[green]met[/]" if ok else "[red]missed[/]"),
                  f"{fmt_ms(r['et_step_s'])} / {fmt_ms(r['eager_step_s'])}",
                  fmt_x(r["time_ratio_interleaved"]))
    console.print(t)
    t = Table(title=f"memory of a process that loads one chunk and runs steps (target <= {MEM_TARGET}x floor)")
    for c in ("chunk", "N", "floor", "peak PSS", "ratio", "baseline PSS", "ratio net", "target / net",
              "peak RSS", "RSS ratio"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["chunk"]), str(r["loss_positions"]), mib(r["floor_bytes"]), mib(r["peak_pss"]),
                  f"{r['mem_ratio_pss']:.2f}x", mib(r["baseline_pss"]), f"{r['mem_ratio_pss_net']:.2f}x",
                  ("[green]met[/]" if r["mem_ok"] else "[red]missed[/]") + " / " +
                  ("[green]met[/]" if r["mem_ok_net_pss"] else "[red]missed[/]"),
                  mib(r["peak_rss"]), f"{r['mem_ratio_raw']:.2f}x")
    console.print(t)
    console.print("floor = .ptd (frozen weights incl. readout) + saved activations + h_k; ratio = peak PSS "
                  f"(sampled every {PSS_INTERVAL_S * 1e3:.0f} ms from outside) / floor; net = (peak PSS - PSS of a "
                  "process that only imported torch + the ExecuTorch runtime) / floor; RSS counts the .ptd "
                  "twice (one mapping per method).", style="dim")
    for r in rows:
        if r.get("profile"):
            t = Table(title=f"chunk {r['chunk']} N={r['loss_positions']}: ETDump, warm step, top operators")
            for c in ("method", "operator", "calls", "ms"):
                t.add_column(c, justify="right" if c in ("calls", "ms") else "left")
            for p in r["profile"][:14]:
                t.add_row(p["block"], p["op"], str(p["calls"]), f"{p['ms']:.1f}")
            console.print(t)


def fmt_x(ratio):
    return "-" if ratio is None else f"{ratio:.2f}x"


def fmt_ms(s):
    return "-" if s is None else f"{s * 1e3:,.0f} ms"


def planned(r, method):
    b = (r.get("pte_ops") or {}).get(method, {}).get("planned_bytes")
    return mib(b) if b is not None else "-"


def _load_note(rows) -> str:
    """The 1-minute load average before and after the timed steps, over the rows shown."""
    la = [pair[0] for r in rows for pair in (r.get("loadavg") or [])]
    return f"1-minute load average around the timed steps: {min(la):.1f}-{max(la):.1f}." if la else ""


def markdown(rows, meta) -> str:
    m = meta["machine"]
    out = [
        "Script: `python bench/export_tinyllama.py` (options: `--only-chunk K`, `--loss-positions 128,16`, "
        "`--backend`, `--steps`, `--skip-export DIR`, `--profile`); raw figures, per-step times and the "
        "ETDump operator profile: `bench/results/export_tinyllama.json`.",
        "",
        f"- Model: TinyLlama-1.1B shapes, random init (seed {MODEL_SEED}): hidden 2048, intermediate 5632, "
        "22 layers, 32 heads / 4 KV heads, vocab 32000, fp32; LoRA r=8 on q_proj,v_proj; "
        "chunks 0-6, 7-13, 14-21; B=1, S=128; N = loss (readout) positions per micro-batch "
        "(128 = every position; 16 = readout only at answer positions, the realistic AG-News case).",
        f"- Machine: {m['cpu']} (lscpu model name), {m['cores']} cores, {m['mem_total'] / (1 << 30):.0f} GiB RAM, "
        f"no GPU; torch {meta['versions'].get('torch')}, executorch {meta['versions'].get('executorch')} "
        f"(pybindings); {rows[0]['threads']} threads for both torch and the ExecuTorch threadpool "
        f"(`_unsafe_reset_threadpool`). Last run: {meta['date']}, commit {meta.get('git')}. {_load_note(rows)}",
        "- Step time: median over the timed steps (after 1 warm-up); ExecuTorch step = phase1 + phase2 "
        "(`zl_common.program.ChunkProgram`), eager = the same `ChunkModel` forward + `loss.backward()`, "
        "same batch and LoRA values. **Alone**: each runtime in a fresh process of its own (a phone runs "
        "only ExecuTorch), the two in turn, `rounds` times (so a drift of the machine's speed hits both); "
        "ratio = the median of the rounds' ratios, and the target (ET <= 1.5x eager) is judged on it. "
        "**Interleaved**: both in one process, alternating step by step (robust to load from other "
        "processes, but the two runtimes' thread pools slow each other: both steps come out slower).",
        "- Memory: a fresh process loads one chunk and runs 1 warm-up + 5 steps, its PSS sampled from "
        f"outside every {PSS_INTERVAL_S * 1e3:.0f} ms; peak PSS = the largest sample. "
        "Floor = .ptd (frozen weights incl. readout) + saved activations (manifest) + h_k. "
        "Ratio = peak PSS / floor (the target, <= 1.25x, is judged on it); *net* = (peak PSS - PSS of a "
        "process that only imported torch + the ExecuTorch runtime) / floor. Peak RSS (VmHWM) is shown "
        "too, but it counts the .ptd twice: the runtime maps the weights once per method (same file "
        "pages). \"planned\" = the method's memory-planned arena (`non_const_buffer_sizes`), allocated at "
        "load for each method.",
        "",
        "| chunk | layers | backend | N | export | export peak RSS* | .pte | .ptd | saved acts | steps | ET phase1 "
        "| ET phase2 | ET step | eager step | ET / eager (rounds) | time target | interleaved: ET / eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['chunk']} | {r['layers'][0]}-{r['layers'][1]} | {r['backend']} | {r['loss_positions']} "
            f"| {r['export_s'] or 0:.0f} s | {mib(r['export_peak_rss'])} | {r['pte_bytes'] / 1024:,.0f} KiB "
            f"| {mib(r['ptd_bytes'])} | {mib(r['saved_activation_bytes'])} | {r['steps']} "
            f"| {fmt_ms(r['et_phase1_s_fresh_process'])} | {fmt_ms(r['et_phase2_s_fresh_process'])} "
            f"| {fmt_ms(r['et_step_s_fresh_process'])} | {fmt_ms(r['eager_step_s_fresh_process'])} "
            f"| {fmt_x(r['time_ratio'])} ({', '.join(f'{x:.2f}' for x in r['round_ratios'])}) "
            f"| {'-' if r['time_ok'] is None else 'met' if r['time_ok'] else '**missed**'} "
            f"| {fmt_ms(r['et_step_s'])} / {fmt_ms(r['eager_step_s'])} = {fmt_x(r['time_ratio_interleaved'])} |")
    out += ["", "\\* of the exporting process, which also holds the whole 22-layer model (4.6 GiB RSS).",
            "", "| chunk | N | floor | peak PSS | ratio | baseline PSS (imports only) | net ratio "
                "| memory target (ratio / net) | PSS after a step | planned phase1 / phase2 | peak RSS (ratio) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['chunk']} | {r['loss_positions']} | {mib(r['floor_bytes'])} | {mib(r['peak_pss'])} "
            f"| {r['mem_ratio_pss']:.2f}x | {mib(r['baseline_pss'])} | {r['mem_ratio_pss_net']:.2f}x "
            f"| {'met' if r['mem_ok'] else '**missed**'} / {'met' if r['mem_ok_net_pss'] else '**missed**'} "
            f"| {mib(r['pss_after_step'])} | {planned(r, 'phase1')} / {planned(r, 'phase2')} "
            f"| {mib(r['peak_rss'])} ({r['mem_ratio_raw']:.2f}x) |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    from exporter.chunk_spec import DEFAULT_CHUNKS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default=DEFAULT_CHUNKS, help="chunk spec (default %(default)s)")
    p.add_argument("--only-chunk", type=lambda v: [int(x) for x in v.split(",")], default=None, metavar="K[,K..]",
                   help="export and measure only chunk K (or a comma list)")
    p.add_argument("--backend", default="xnnpack", choices=["xnnpack", "portable"])
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3,
                   help="ExecuTorch-alone and eager-alone processes run in turn this many times (ratio: median)")
    p.add_argument("--mem-steps", type=int, default=2,
                   help="steps (after the warm-up) run by the fresh process that measures peak memory")
    p.add_argument("--loss-positions", default="128",
                   help="readout rows per micro-batch, comma list; one export per value (e.g. 128,16)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", type=Path, default=Path("/tmp/zl_bench_tinyllama"),
                   help="where exports go (one sub-directory per backend and N); kept for --skip-export")
    p.add_argument("--skip-export", type=Path, default=None, metavar="DIR",
                   help="reuse the export in DIR (its manifest gives N and backend); still builds the "
                        "model for the eager comparison unless --no-eager")
    p.add_argument("--no-eager", action="store_true", help="skip the eager PyTorch comparison")
    p.add_argument("--profile", action="store_true", help="also run one ETDump-profiled step per chunk")
    p.add_argument("--config", default="tinyllama", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    p.add_argument("--write-model-dir", type=Path, default=None, metavar="DIR",
                   help="only write the random-init model (+ the tiny tokenizer) as a Hugging Face model dir, "
                        "for zl-export --model DIR (e.g. BP programs for bench/pipeline.py), then exit")
    p.add_argument("--results", type=Path, default=RESULTS)
    # internal: the measuring subprocess
    p.add_argument("--worker", choices=["baseline", "run", "eager", "profile"], help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.write_model_dir:
        from exporter.tiny_tokenizer import build_tiny_tokenizer

        build_model(a.config).save_pretrained(a.write_model_dir)
        build_tiny_tokenizer().save_pretrained(a.write_model_dir)  # ids < 512 fit any vocab
        print(f"wrote {a.write_model_dir}")
        return 0
    if a.worker:
        Path(a.result).write_text(json.dumps(worker(a)))
        return 0

    from rich.console import Console
    console = Console()
    t_start = time.time()

    def say(msg):
        console.print(f"[dim]{time.time() - t_start:7.1f}s[/] {msg}")

    import torch
    torch.set_num_threads(a.threads)
    from exporter.chunk_spec import parse_chunk_spec
    from exporter.config import ExportConfig
    from exporter.export import versions

    jobs = []  # (loss_positions, export_dir, manifest or None)
    if a.skip_export:
        m = json.loads((a.skip_export / "manifest.json").read_text())
        jobs.append((m["export"]["readout_rows"], a.skip_export, m))
        a.backend = m["export"]["backend"]
    else:
        for lp in (int(x) for x in a.loss_positions.split(",")):
            jobs.append((lp, a.out / f"{a.config}_{a.backend}_lp{lp}", None))
    hf = CONFIGS[a.config]
    ranges = parse_chunk_spec(a.chunks, hf["num_hidden_layers"])

    model = peft_model = None
    if not (a.skip_export and a.no_eager):
        say(f"building the {a.config} model (random init, seed {MODEL_SEED})")
        model = build_model(a.config)
        from exporter.chunk_model import add_lora
        peft_model = add_lora(model, ExportConfig())
        say(f"model ready: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
            f"RSS {mib(proc_status()['VmRSS'])}")

    say("baseline: a process that only imports torch + the ExecuTorch runtime")
    base = run_worker("baseline", a, Path("/tmp"), -1)
    say(f"baseline RSS {mib(base['after_import']['rss'])}, PSS {mib(base['after_import']['pss'])}")

    rows = []
    for lp, export_dir, manifest in jobs:
        cfg = ExportConfig(loss_positions=None if lp == 128 else lp, backend=a.backend)
        if manifest is None:
            indices = a.only_chunk if a.only_chunk is not None else list(range(len(ranges)))
            say(f"exporting chunks {indices} with N={lp} into {export_dir}")
            manifest, _ = export_chunks(peft_model, model.config, ranges, indices, cfg, export_dir, say)
        entries = [c for c in manifest["chunks"] if a.only_chunk is None or c["index"] in a.only_chunk]
        for entry in entries:
            k = entry["index"]
            eager = None
            if not a.no_eager:
                from exporter.chunk_model import ChunkModel
                first, last = entry["layers"]
                chunk = ChunkModel(peft_model, first, last, cfg).eval()
                say(f"chunk {k} N={lp}: eager forward+backward and ExecuTorch phase1+phase2, interleaved, "
                    f"x{a.warmup + a.steps}")
                la0 = os.getloadavg()
                eager = interleaved_times(chunk, manifest, entry, Path(export_dir), a.steps, a.warmup, a.threads)
                eager["loadavg"] = [la0, os.getloadavg()]
                del chunk
                gc.collect()
            rounds = []
            for i in range(a.rounds):
                say(f"chunk {k} N={lp}, round {i + 1}/{a.rounds}: memory and ExecuTorch alone: a fresh process "
                    f"loads the chunk and runs x{a.warmup + max(a.mem_steps, a.steps)}")
                et = run_worker("run", a, export_dir, k)
                eager_alone = None
                if not a.no_eager:
                    say(f"chunk {k} N={lp}, round {i + 1}/{a.rounds}: eager forward+backward alone in a fresh "
                        f"process, x{a.warmup + a.steps}")
                    eager_alone = run_worker("eager", a, export_dir, k)
                rounds.append((et, eager_alone))
            ops = pte_ops(Path(export_dir) / entry["program"])
            row = summarize(manifest, entry, export_dir, eager, rounds, base, ops, a, lp)
            if a.profile:
                say(f"chunk {k} N={lp}: ETDump profile")
                prof = run_worker("profile", a, export_dir, k)
                row["profile"], row["profile_totals_ms"] = prof["profile"], prof["profile_totals_ms"]
            say(f"chunk {k} N={lp}: alone: ET step {fmt_ms(row['et_step_s_fresh_process'])}, eager "
                f"{fmt_ms(row['eager_step_s_fresh_process'])}; interleaved: ET {fmt_ms(row['et_step_s'])}, eager "
                f"{fmt_ms(row['eager_step_s'])}; "
                f"ratio per round {', '.join(f'{x:.2f}x' for x in row['round_ratios'])}; "
                f"peak PSS {row['mem_ratio_pss']:.2f}x the floor ({row['mem_ratio_pss_net']:.2f}x net); "
                f"loss ET {row['loss_et']:.5f} eager {row['loss_eager']}, max rel grad diff {row['max_rel_grad_diff']}")
            rows.append(row)

    try:
        git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "exporter", "zl_mobile"],
                               capture_output=True, text=True).stdout.strip()
        git += " (exporter/ or zl_mobile/ modified)" if dirty else ""
    except OSError:
        git = None
    meta = {"date": now_iso(), "machine": machine(), "versions": versions(), "git": git,
            "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:]))}
    print_tables(rows, console)

    # merge with earlier runs (keyed by config/backend/N/chunk) so chunks can be run one at a time
    old = json.loads(a.results.read_text()) if a.results.exists() else {"runs": {}}
    for r in rows:
        old["runs"][r["key"]] = r | {"meta": meta}
    a.results.parent.mkdir(parents=True, exist_ok=True)
    a.results.write_text(json.dumps(old, indent=1) + "\n")
    say(f"results: {a.results}")
    if not a.no_doc:
        all_rows = [r for r in old["runs"].values()
                    if r["config"] == "tinyllama" and r.get("eager_step_s_fresh_process")]
        if all_rows:
            all_rows.sort(key=lambda r: (r["backend"], -r["loss_positions"], r["chunk"]))
            for r in all_rows:  # rows from runs before the planned-arena column was added
                pte = Path(r["export_dir"]) / f"chunk_{r['chunk']}.pte"
                if "planned_bytes" not in r["pte_ops"].get("phase1", {}) and pte.is_file():
                    r["pte_ops"] = pte_ops(pte)
            meta_doc = max((r["meta"] for r in all_rows), key=lambda m: m["date"])
            replace_md_section(DOC, HEADING, markdown(all_rows, meta_doc), "ZeroLock benchmarks",
                               keep_from=FINDINGS)
            say(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
