"""Recovery benchmark: local replay (ZeroLock) vs global rollback (the BP-pipeline baseline).

Three stages, b=1 (micro-batch of one sample), m=8 (window_size 8 micro-batches per optimizer
step), 8 windows; a failure is injected at stage 1 in window 4, after phase 1. In ONE script run
it executes three configurations on the same export and data:

  none      uninterrupted run (the reference for LoRA and for link bytes)
  local     only the failed stage restarts, reloads its own checkpoint and replays the hidden
            states its upstream neighbour still buffers
  global    every stage goes back to the last globally consistent checkpoint and the whole
            pipeline replays from there

Reported per recovery: latency = caught_up - detected (split into detected -> rejoined, which is
the process restart + connect + re-push, and rejoined -> caught up, which is the replay), extra
link bytes = link_bytes(run) - link_bytes(uninterrupted run), file bytes re-pushed after the
failure, and the largest LoRA difference to the uninterrupted run. Ratios are local / global.

Failure modes (`--failure-modes`, each run with both recoveries, interleaved over `--reps`):
  process        the phone process exits at the point (os._exit): a restart of the process,
                 imports and program load included; detected by the dropped connection
  app            the stage fails inside the running phone (it drops its in-memory state, the
                 app serves on, as the seed's E2 keeps its workers alive): detected by the
                 dropped session; the host reconnects and the stage restores its checkpoint
  app-heartbeat  the same, but the phone goes silent: detected by the heartbeat timeout
                 (`--heartbeat-timeout`); latency counts from detection, and the detection
                 delay (failure -> detected, from the phone's injection marker) is shown apart
Phones are budgeted as for bench/pipeline.py (`--cpu-share auto`: 0.6 of a core each at three
stages), so each stage computes on its own share and none steals from another.

Usage:
  python bench/recovery.py --export DIR --make-export  # export the benchmark model first (~1 min)
  python bench/recovery.py --export DIR            # an export with 3 chunks, micro_batch 1
  python bench/recovery.py --export DIR --reps 2   # repeat the failure configs, report medians
Results: bench/results/recovery.json (raw), printed table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, MiB, bench_micro_batches, cpu_shares, machine, median, now_iso, run_on_phones  # noqa: E402

warnings.filterwarnings("ignore")

PAPER = {"latency_ms": (2013, 2381), "bytes_mib": (96, 192)}
FAILURE_MODES = {"process": {}, "app": {"mode": "app", "detect": "connection"},
                 "app-heartbeat": {"mode": "app", "detect": "heartbeat"}}


BENCH_MODEL = dict(num_hidden_layers=6, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                   num_key_value_heads=4)


def make_export(out: Path, chunks: str, micro_batch: int, modes=("zerolock",), seq_len: int = 128,
                eager_weights: bool = False, num_layers: int | None = None) -> Path:
    """The benchmarks' model: a random-init 6-layer Llama (BENCH_MODEL, torch seed 7; `num_layers`
    overrides the depth) with the repo's tiny tokenizer, exported with XNNPACK. Recovery: chunks
    "0-1,2-3,4-5", micro_batch 1; pipeline: chunks "0-2,3-5", micro_batch 2, modes ("zerolock", "bp").
    `eager_weights`: also the files the eager backend reads (zl-export --eager-weights)."""
    import torch
    from transformers import LlamaForCausalLM

    from exporter.config import ExportConfig
    from exporter.export import export_model
    from exporter.model_source import llama_config
    from exporter.tiny_tokenizer import build_tiny_tokenizer

    out = Path(out)
    layers = num_layers or BENCH_MODEL["num_hidden_layers"]
    model_dir = out.parent / (out.name + "-model" + ("" if layers == BENCH_MODEL["num_hidden_layers"] else f"-{layers}l"))
    if not (model_dir / "config.json").exists():
        torch.manual_seed(7)
        LlamaForCausalLM(llama_config(**{**BENCH_MODEL, "num_hidden_layers": layers})).save_pretrained(model_dir)
        build_tiny_tokenizer().save_pretrained(model_dir)
    cfg = ExportConfig(lora_rank=8, lora_alpha=16.0, seq_len=seq_len, micro_batch=micro_batch, backend="xnnpack")
    t = time.time()
    export_model(str(model_dir), chunks, out, cfg, progress=print, modes=tuple(modes), eager_weights=eager_weights)
    print(f"export: {time.time() - t:.0f} s -> {out}", flush=True)
    return out


def wire_upload_bytes(network) -> int:
    """What the phones sent, as the kernel counts it on each phone's veth (bytes the bridge
    received from it): exact whatever happens to a phone process, replays included."""
    return sum(int(Path(f"/sys/class/net/{ph.host_dev}/statistics/rx_bytes").read_text()) for ph in network.phones)


def run_once(export_dir: Path, root: Path, settings, mbs, n_phones: int, phone_args=None,
             max_seconds: float = 240.0, shares=None, netns: bool = False) -> dict:
    """One coordinator run over emulated phones, with the host's events timed as they happen;
    with `netns`, each phone in a namespace of its own (unshaped), so the kernel counts its traffic."""
    from host.phones.netns import ShapedNetwork

    events = []
    t0 = time.time()
    with (ShapedNetwork(n_phones, None) if netns else contextlib.nullcontext()) as network:
        result, records = run_on_phones(export_dir, root, settings, mbs, n_phones, prefix="rb",
                                        extra_args=phone_args, max_seconds=max_seconds, cpu_shares=shares,
                                        network=network, on_event=lambda k, d: events.append((time.time(), k, d)))
        result["wire_bytes"] = wire_upload_bytes(network) if network is not None else None
    result["wall_s"] = time.time() - t0
    # when the failure happened, on the phone's clock (the same machine): its injection marker
    result["injected_at"] = sorted(m.stat().st_mtime for m in Path(root).glob("phones/*/failure-injected-*"))
    result["events"] = events
    result["records"] = records
    return result


def received_bytes(records) -> int:
    """Link bytes as the receivers count them: per stage, the sum over its incarnations of the
    last bytes_in it reported (a restart starts its counter from zero). Unlike the coordinator's
    link_bytes (sender side, from telemetry), this sees replays that a finished upstream sends
    after its last telemetry."""
    total = 0
    for k in sorted({r["stage"] for r in records if r["type"] == "TELEMETRY"}):
        seq = [r.get("bytes_in", 0) for r in records
               if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch" and r["stage"] == k]
        last = 0
        for b in seq:
            if b < last:
                total += last
            last = b
        total += last
    return total


def caught_up_from_records(records, rec) -> float | None:
    """First time (host clock) after the rejoin at which every recovered stage reported a
    micro-batch >= the frontier (the furthest micro-batch any stage had done at detection)."""
    need = set(rec["stages"])
    seen = set()
    for r in records:
        if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch" and r["t"] >= rec["rejoined"] and r["stage"] in need \
                and r["micro_batch"] >= rec["frontier"]:
            seen.add(r["stage"])
            if seen == need:
                return r["t"]
    return None


def resumed_from_records(records, rec) -> float | None:
    """First time (host clock) after the rejoin at which every recovered stage is back where it
    was: it reported a micro-batch >= the last one it had reported before the failure was detected
    (lost work redone; "caught up" asks more: the frontier, where the furthest stage had got)."""
    tel = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch"]
    own = {k: max([r["micro_batch"] for r in tel if r["stage"] == k and r["t"] < rec["detected"]], default=-1)
           for k in rec["stages"]}
    seen = set()
    for r in tel:
        if r["t"] >= rec["rejoined"] and r["stage"] in own and r["micro_batch"] >= own[r["stage"]]:
            seen.add(r["stage"])
            if seen == set(own):
                return r["t"]
    return None


def summarize(result: dict, base: dict | None) -> dict:
    import numpy as np

    rb = received_bytes(result["records"])
    out = {"seconds": result["seconds"], "link_bytes_sender": result["link_bytes"], "link_bytes": rb,
           "errors": result["errors"]}
    out["wire_bytes"] = result.get("wire_bytes")
    if base is not None:
        if result.get("wire_bytes") is not None and base.get("wire_bytes") is not None:
            out["extra_wire_bytes"] = result["wire_bytes"] - base["wire_bytes"]
        out["extra_link_bytes"] = rb - received_bytes(base["records"])
        out["extra_link_bytes_sender"] = result["link_bytes"] - base["link_bytes"]
        out["lora_max_abs_diff"] = max(float(np.abs(result["lora"][n] - base["lora"][n]).max()) for n in base["lora"])
        out["extra_seconds"] = result["seconds"] - base["seconds"]
    recs = []
    for r in result["recoveries"]:
        det, rej = r["detected"], r["rejoined"]
        cu = caught_up_from_records(result["records"], r) or r["caught_up"]
        back = resumed_from_records(result["records"], r)
        # files (program, weights, LoRA init, manifest) pushed again after the failure
        pushed = sum(d.get("sent", 0) or 0 for t, k, d in result["events"] if k == "push" and t >= det)
        injected = [t for t in result.get("injected_at", []) if t <= det]
        recs.append({"kind": r["kind"], "stages": r["stages"], "why": r["why"], "frontier": r["frontier"],
                     "detection_s": (det - injected[-1]) if injected else None,
                     "resumed_after_window": r["resumed_after_window"],
                     "latency_s": (cu - det) if cu else None, "resumed_s": (back - det) if back else None,
                     "coordinator_caught_up_s":
                     (r["caught_up"] - det) if r["caught_up"] else None, "restart_s": rej - det,
                     "replay_s": (cu - rej) if cu else None, "file_bytes_repushed": pushed,
                     "bytes_at_detection": r["bytes_at_detection"]})
    out["recoveries"] = recs
    commits = [(r["stage"], r["window"]) for r in result["records"] if r["type"] == "CHECKPOINT_COMMITTED"]
    out["commits"] = len(commits)
    out["recommitted_windows"] = len(commits) - len(set(commits))
    mbs_done = [(r["stage"], r["micro_batch"]) for r in result["records"]
                if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch"]
    out["micro_batch_steps"] = len(mbs_done)
    out["recomputed_micro_batch_steps"] = len(mbs_done) - len(set(mbs_done))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True, help="export dir: 3 chunks, micro_batch 1")
    ap.add_argument("--make-export", action="store_true", help="first export the benchmark model into --export")
    ap.add_argument("--work", type=Path, default=Path("/tmp/zl-bench-recovery"))
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window-size", type=int, default=8)
    ap.add_argument("--inflight-depth", type=int, default=2)
    ap.add_argument("--replay-horizon", type=int, default=None,
                    help="hidden states an upstream keeps for replay (default 4 windows)")
    ap.add_argument("--fail-stage", type=int, default=1)
    ap.add_argument("--fail-window", type=int, default=4)
    ap.add_argument("--point", default="after-phase1")
    ap.add_argument("--reps", type=int, default=1, help="repeats of each failure config (medians reported)")
    ap.add_argument("--failure-modes", default="process,app,app-heartbeat",
                    help=f"comma-separated, of {', '.join(FAILURE_MODES)} (see above)")
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0,
                    help="seconds of silence after which the host takes a phone for failed")
    ap.add_argument("--links", choices=["auto", "netns", "loopback"], default="auto",
                    help="netns: every phone in its own network namespace, its traffic counted by the kernel "
                         "(the extra bytes of a recovery, exactly); auto: netns where the machine allows it")
    ap.add_argument("--cpu-share", default="auto",
                    help="each phone's share of a core: F, F1,... (one per stage), none (pinned cores), or auto "
                         "(1.8 / stages at 3 and 4 stages)")
    ap.add_argument("--rate-mbit", type=float, default=None, help="shape every phone's outgoing links")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/recovery.json")
    a = ap.parse_args(argv)

    from exporter.manifest import load_manifest
    from host.run.settings import RunSettings

    if a.make_export:
        make_export(a.export, "0-1,2-3,4-5", micro_batch=1)
    man = load_manifest(a.export)
    ecfg = man.get("export", {})
    mb_size, seq = ecfg.get("micro_batch", 1), ecfg.get("seq_len", 128)
    n_stages = len(man["chunks"])
    mbs = bench_micro_batches(a.export, a.windows * a.window_size, mb_size, seq)
    phone_args = ["--rate-mbit", str(a.rate_mbit)] if a.rate_mbit else None
    base_kw = dict(windows=a.windows, window_size=a.window_size, inflight_depth=a.inflight_depth, lr=2e-3,
                   replay_horizon=a.replay_horizon or 4 * a.window_size)
    modes = a.failure_modes.split(",")
    if not set(modes) <= set(FAILURE_MODES):
        ap.error(f"--failure-modes {a.failure_modes}: use some of {', '.join(FAILURE_MODES)}")
    try:
        shares = cpu_shares(a.cpu_share, n_stages)
    except ValueError as e:
        ap.error(str(e))
    base_kw["heartbeat_timeout"] = a.heartbeat_timeout
    from host.phones.netns import unavailable as netns_unavailable

    why_not = netns_unavailable()
    if a.links == "netns" and why_not:
        ap.error(f"--links netns: {why_not}")
    netns = a.links == "netns" or (a.links == "auto" and not why_not)
    failure = {"stage": a.fail_stage, "window": a.fail_window, "point": a.point}
    configs = [("none", None, RunSettings(**base_kw))]
    for rep in range(a.reps):
        for mode in modes:
            spec = [{**failure, **FAILURE_MODES[mode]}]
            configs += [("local", mode, RunSettings(**base_kw, inject_failure=spec, recovery="local")),
                        ("global-rollback", mode, RunSettings(**base_kw, inject_failure=spec, recovery="global-rollback"))]

    stamp = time.strftime("%H%M%S")
    runs, base = [], None
    for i, (name, mode, settings) in enumerate(configs):
        label = name if mode is None else f"{mode}/{name}"
        root = a.work / f"{stamp}-{i}-{label.replace('/', '-')}"
        t = time.time()
        try:
            res = run_once(a.export, root, settings, mbs, n_stages, phone_args, shares=shares, netns=netns)
        except Exception as e:  # keep going: report what failed
            print(f"[{label}] FAILED: {e}", flush=True)
            runs.append({"config": name, "mode": mode, "failed": str(e), "recoveries": []})
            continue
        s = summarize(res, base)
        if name == "none":
            base = res
        s["config"], s["mode"] = name, mode
        runs.append(s)
        rec = s["recoveries"][0] if s["recoveries"] else {}
        print(f"[{label}] {time.time() - t:.1f} s wall, run {s['seconds']:.1f} s, link {s['link_bytes'] / MiB:.1f} MiB"
              + (f", latency {rec['latency_s'] * 1e3:.0f} ms (restart {rec['restart_s'] * 1e3:.0f} + replay "
                 f"{rec['replay_s'] * 1e3:.0f}), extra {s['extra_link_bytes'] / MiB:.2f} MiB, "
                 f"lora diff {s['lora_max_abs_diff']:.2g}" if rec and rec.get("latency_s") else ""), flush=True)

    def agg(mode, kind, key):
        return median([r["recoveries"][0][key] for r in runs if (r["config"], r["mode"]) == (kind, mode)
                       and r["recoveries"] and r["recoveries"][0].get(key) is not None])

    def agg_run(mode, kind, key):
        return median([r[key] for r in runs if (r["config"], r["mode"]) == (kind, mode) and r.get(key) is not None])

    def ratio(x, y):
        return x / y if x is not None and y else None

    paper = {"latency": PAPER["latency_ms"][0] / PAPER["latency_ms"][1], "bytes": PAPER["bytes_mib"][0] / PAPER["bytes_mib"][1]}
    table, ratios = {}, {}
    keys = ("latency_s", "resumed_s", "restart_s", "replay_s", "detection_s", "file_bytes_repushed", "coordinator_caught_up_s")
    run_keys = ("extra_wire_bytes", "extra_link_bytes", "extra_seconds", "recomputed_micro_batch_steps", "recommitted_windows",
                "extra_link_bytes_sender")
    for mode in modes:
        for kind in ("local", "global-rollback"):
            table[f"{mode}/{kind}"] = {**{k: agg(mode, kind, k) for k in keys}, **{k: agg_run(mode, kind, k) for k in run_keys},
                                       "lora_max_abs_diff": max([r["lora_max_abs_diff"] for r in runs
                                                                 if (r["config"], r["mode"]) == (kind, mode)
                                                                 and "lora_max_abs_diff" in r] or [float("nan")])}
        L, G = table[f"{mode}/local"], table[f"{mode}/global-rollback"]
        ratios[mode] = {"latency": ratio(L["latency_s"], G["latency_s"]), "replay": ratio(L["replay_s"], G["replay_s"]),
                        "resumed": ratio(L["resumed_s"], G["resumed_s"]),
                        "extra_link_bytes": ratio(L["extra_link_bytes"], G["extra_link_bytes"]),
                        "extra_wire_bytes": ratio(L["extra_wire_bytes"], G["extra_wire_bytes"]),
                        "extra_seconds": ratio(L["extra_seconds"], G["extra_seconds"])}

    def ms(v):
        return "-" if v is None else f"{v * 1e3:,.0f} ms"

    def mib(v):
        return "-" if v is None else f"{v / MiB:,.2f} MiB"

    def num(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    print()
    print("| failure / recovery | detection | latency (detected -> caught up) | detected -> back where it was | restart | "
          "replay | extra bytes sent "
          "(kernel) | extra bytes received (telemetry) | files re-pushed | recomputed mb-steps | re-committed windows | "
          "LoRA max |diff| vs uninterrupted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in table.items():
        print(f"| {label} | {ms(r['detection_s'])} | {ms(r['latency_s'])} | {ms(r['resumed_s'])} | {ms(r['restart_s'])} | "
              f"{ms(r['replay_s'])} | "
              f"{mib(r['extra_wire_bytes'])} | {mib(r['extra_link_bytes'])} | {mib(r['file_bytes_repushed'])} | "
              f"{num(r['recomputed_micro_batch_steps'], '.0f')} | "
              f"{num(r['recommitted_windows'], '.0f')} | {num(r['lora_max_abs_diff'], '.2g')} |")
    for mode, q in ratios.items():
        print(f"ratios local/global, {mode}: latency {num(q['latency'])} (target <= 0.5; paper {paper['latency']:.3f}), "
              f"back where it was {num(q['resumed'])}, replay part {num(q['replay'])}, "
              f"extra bytes sent {num(q['extra_wire_bytes'])} (target <= 0.34; paper "
              f"{paper['bytes']:.3f}; received, by telemetry: {num(q['extra_link_bytes'])}), "
              f"extra run time {num(q['extra_seconds'])}")

    out = {"date": now_iso(), "machine": machine(), "export": str(a.export), "export_config": ecfg,
           "model": man.get("model", {}).get("config"), "chunks": [c.get("layers") for c in man["chunks"]],
           "settings": {**base_kw, "micro_batch": mb_size, "seq_len": seq, "stages": n_stages, "failure": failure,
                        "reps": a.reps, "rate_mbit": a.rate_mbit, "failure_modes": modes, "cpu_shares": shares,
                        "links": "netns" if netns else "loopback",
                        "heartbeat_timeout_s": a.heartbeat_timeout},
           "runs": runs, "table": table, "ratios_local_over_global": ratios, "paper_ratios": paper}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
