"""Profile a phone: what a layer, the readout and the runtime cost it, measured on its own runtime.

The host exports two calibration programs of the run's model (its first layer, and its first
n layers, a quarter of the model, 3 to 8: calibration_layers; each one chunk with the embedding
and the readout; same sequence length, micro-batch, readout rows, backend and base weights as the
run) and runs each on the phone as a
one-stage ZeroLock pipeline for a few micro-batches through the ordinary coordinator: files
pushed, STAGE_ASSIGN, hidden states fed, TELEMETRY back. No protocol message is added; the phone
runs exactly what a stage runs. All phones are profiled at once (profile_devices), each timed only
while all of them compute, the faster ones given more micro-batches: a run keeps them all busy, and
emulated phones that share a machine's cores and caches are slower then, so they are measured that
way; real phones do not share, and are done sooner. From the two stage runs:

- time per micro-batch t(n) = fixed + n * per-layer (phase 1 and phase 2 apart; the readout is
  most of phase 2's fixed part); the planner's cost from the stage's busy time per micro-batch
  (wall clock, less waits for input), the window's step from its CPU time / share on a budget
  (paced_busy_s);
- memory: the peak resident set of the 1-layer stage (runtime + weights + activations as the
  kernel counts them), the frozen weights per layer, of the readout and of the embedding from the
  programs' weight files (exact), the activations a further held forward keeps per layer from the
  export (saved_activation_bytes), and the runtime's PSS before any program was loaded;
- the phone's memory budget from HELLO (memory_budget_bytes: an Android app's available memory, an
  emulated phone's --mem-limit), and the host -> phone rate of the calibration push.

A profile is a JSON file per device; host.planning.split_planner.PhoneModel is built from it."""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from .split_planner import PhoneModel

PROFILE_FORMAT = "zerolock-profile"
CALIBRATION_WINDOW = 4  # micro-batches per update window of a calibration stage
EXPORT_KEYS = ("seq_len", "micro_batch", "loss_positions", "backend", "base_weights", "lora_rank", "lora_alpha",
               "target_modules", "xnnpack_ops")


class ProfileError(Exception):
    """A profile that could not be made or read (one line, with the fix)."""


# ---------------------------------------------------------------- calibration programs
def model_layers(model: str) -> int:
    """The number of layers of --model (tiny, smollm2, a .gguf file or a HF Llama dir), from its
    config, without loading weights."""
    from exporter.errors import ExportError
    from exporter.model_source import resolve_model, source_num_layers

    try:
        return source_num_layers(*resolve_model(model))
    except ExportError as e:
        raise ProfileError(str(e)) from None


def calibration_layers(num_layers: int) -> tuple[int, int]:
    """The two calibration programs' layer counts: 1, and a quarter of the model (3 to 8). The
    per-layer cost is the slope between them, so the further apart the less a millisecond of noise
    in either moves it: from 1 vs 3 layers of the tiny model it came out 1.5-3.2 ms a layer on
    phones running the same program; a plan extrapolates it to 10-20 layers."""
    return 1, min(num_layers, max(3, min(8, num_layers // 4)))


def _truncated_model(model: str, layers: int):
    import torch

    from exporter.model_source import build_tiny_model, load_base_model, resolve_model

    source, path = resolve_model(model)
    m = build_tiny_model() if source == "tiny" else load_base_model(path)
    m.model.layers = torch.nn.ModuleList(list(m.model.layers)[:layers])
    m.config.num_hidden_layers = layers
    if isinstance(getattr(m.config, "layer_types", None), list):
        m.config.layer_types = m.config.layer_types[:layers]
    return m


def export_calibration(model: str, export: dict, out: Path, progress=None) -> dict[int, Path]:
    """The calibration programs (layers -> export dir) under `out`, exported unless an earlier
    call left the same ones there."""
    from exporter.config import ExportConfig
    from exporter.export import export_model

    keys = {k: export[k] for k in EXPORT_KEYS if k in export}
    if "target_modules" in keys:
        keys["target_modules"] = tuple(keys["target_modules"])
    cfg = ExportConfig(**keys)
    stamp = {"model": str(Path(model).absolute()) if model != "tiny" else "tiny", "export": cfg.to_json()}
    out = Path(out)
    dirs = {}
    layers = model_layers(model)
    if layers < 2:
        raise ProfileError(f"{model} has {layers} layer: there is no split to plan; run it on one phone")
    for n in calibration_layers(layers):
        d = out / f"layers_{n}"
        dirs[n] = d
        meta = d / "calibration.json"
        if meta.is_file() and json.loads(meta.read_text()) == stamp and (d / "manifest.json").is_file():
            continue
        if progress:
            progress(f"exporting the {n}-layer calibration program ({cfg.backend}, seq len {cfg.seq_len}, "
                     f"micro-batch {cfg.micro_batch})")
        export_model(model, f"0-{n - 1}", d, cfg, model=_truncated_model(model, n))
        meta.write_text(json.dumps(stamp, indent=2))
    return dirs


def calibration_batches(manifest: dict, count: int, seed: int = 0) -> list[dict]:
    """Micro-batches of random tokens with exactly as many targets as the program's readout rows
    (the readout runs full; more would be refused: zl_common.data.check_loss_positions)."""
    e = manifest["export"]
    b, s, vocab = e["micro_batch"], e["seq_len"], manifest["model"]["config"]["vocab_size"]
    rows = e.get("readout_rows") or e.get("loss_positions") or b * s
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(4, vocab, size=(b, s), dtype=np.int64)
        labels = np.full(b * s, -100, np.int64)  # zl_common.data.IGNORE_INDEX
        labels[b * s - rows:] = np.roll(ids, -1, axis=1).reshape(-1)[b * s - rows:]
        out.append({"input_ids": ids, "attention_mask": np.ones((b, s), np.int64),
                    "position_ids": np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy(),
                    "labels": labels.reshape(b, s)})
    return out


def _weight_bytes(export_dir: Path, chunk: dict, eager: bool) -> dict[str, int]:
    """Frozen weight bytes by part (embedding, readout, layers) of a chunk, from the file the phone
    loads: the .ptd's named tensors, or the eager backend's safetensors."""
    parts = {"embed": 0, "readout": 0, "layers": 0}
    if eager and "eager_weights" in chunk:
        from safetensors import safe_open
        with safe_open(str(export_dir / chunk["eager_weights"]), "pt") as f:
            items = [(k, f.get_slice(k)) for k in f.keys()]
            sizes = {k: int(np.prod(s.get_shape())) * _dtype_bytes(s.get_dtype()) for k, s in items}
    else:
        from exporter.manifest import ptd_contents
        sizes = {k: len(v[1]) for k, v in ptd_contents(export_dir / chunk["weights"]).items()}
    for k, n in sizes.items():
        part = ("embed" if k.startswith("embed") or "embed_tokens" in k
                else "layers" if k.startswith("layers.") or ".layers." in k else "readout")
        parts[part] += n
    return parts


def _dtype_bytes(dtype: str) -> int:
    return {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I64": 8, "I32": 4}.get(dtype, 4)


# ---------------------------------------------------------------- calibration stages
def _calibration_stage(handle, n: int, export_dir: Path, run_root: Path, count: int, links=None,
                       progress=None, label: str = "timed") -> dict:
    """Run the n-layer calibration program on one phone as a one-stage pipeline of `count`
    micro-batches; its HELLO, its telemetry and the file pushes' times."""
    from exporter.manifest import load_manifest

    from ..run.coordinator import Coordinator, RunError
    from ..run.settings import RunSettings
    from .calibration_sink import CalibrationSink

    manifest = load_manifest(export_dir)
    # update windows of a few micro-batches, so the window's step (AdamW, checkpoint) is sampled
    # several times, not once (a garbage collection in a single step read 96 ms for 10)
    windows = max(1, math.ceil(count / CALIBRATION_WINDOW))
    count = windows * CALIBRATION_WINDOW if count > CALIBRATION_WINDOW else count
    settings = RunSettings(windows=windows, window_size=min(count, CALIBRATION_WINDOW), max_seconds=600.0,
                           heartbeat_timeout=30.0, rejoin_timeout=5.0)
    pushes: list[tuple[float, dict]] = []
    start = time.time()

    def on_event(kind, data):
        if kind == "push":
            pushes.append((time.time(), data))
        elif kind == "connected":
            pushes.append((time.time(), {"connected": True}))

    # one run id per stage run: a phone keeps its running stage for a STAGE_ASSIGN of the same run id
    # (a rewire), so the pace pass and the timed pass of the same program must not share one
    run_id = f"profile-{handle.name}-layers_{n}-{label}-{int(start)}"
    run_dir = Path(run_root) / run_id.removeprefix("profile-")
    if progress:
        progress(f"{handle.name}: running the {n}-layer calibration stage ({count} micro-batches)")
    # the stage sends its hidden states downstream, as every stage of a run but the last does
    # (phones behind adb reach the host through its wiring: they calibrate without one)
    sink = CalibrationSink(settings.window_size, settings.inflight_depth) if links is None else None
    try:
        co = Coordinator(export_dir, [handle], calibration_batches(manifest, count), settings, run_dir,
                         run_id=run_id, on_event=on_event, links=links, sink=sink)
        co.run()
    except RunError as e:
        raise ProfileError(f"{handle.name}: the {n}-layer calibration stage failed: {e}") from None
    finally:
        if sink is not None:
            sink.close()
            # what reached the host: the stage's own bytes_out is read before its link thread sends
            (run_dir / "sink.json").write_text(json.dumps({"received": sink.received, "micro_batches": count}))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mbs = [r for r in records if r.get("type") == "TELEMETRY" and r.get("kind", "micro_batch") == "micro_batch"]
    win = [r for r in records if r.get("type") == "TELEMETRY" and r.get("kind") == "window"]
    if len(mbs) < min(count, 3) or not win:
        raise ProfileError(f"{handle.name}: the {n}-layer calibration stage reported {len(mbs)} of {count} "
                           f"micro-batches; see {run_dir}/metrics.jsonl and the phone's log")
    return {"hello": co.stages[0].client.hello.meta, "mbs": sorted(mbs, key=lambda r: r["micro_batch"]),
            "windows": win, "pushes": pushes, "manifest": manifest, "export_dir": export_dir, "layers": n}


def _busy_per_micro_batch(mbs: list[dict], windows: list[dict] = ()) -> float:
    """What a micro-batch costs the stage when it never waits: its busy time from one phase 2's end
    to the next, less waiting for input (the telemetry, sends and receives between the phases are
    the stage's work too) and less the windows' steps in between (the planner adds the step apart)."""
    first, last = mbs[0], mbs[-1]
    step = {w["window"]: w["step_s"] for w in windows}
    steps = sum(step.get(a["window"], 0.0) for a, b in zip(mbs, mbs[1:]) if a["window"] != b["window"])
    return ((last["phase2_end"] - first["phase2_end"]) - (last["wait_s"] - first["wait_s"]) - steps) / (len(mbs) - 1)


def _common_window(stages: list[dict]) -> tuple[float, float]:
    """The span in which every phone was running its calibration stage, past its warm-up
    micro-batch: phones that share a machine's cores and caches (emulated ones) are only measured
    while all of them compute, as they do in a run."""
    return (max(st["mbs"][1]["phase2_end"] for st in stages), min(st["mbs"][-1]["phase2_end"] for st in stages))


def _stage_figures(st: dict, window: tuple[float, float]) -> dict:
    """One calibration stage's figures, timed on its micro-batches inside `window` (all of them
    after the warm-up when fewer than four fall inside)."""
    steady = st["mbs"][1:]  # the first one warms the runtime up
    inside = [r for r in steady if window[0] <= r["phase2_end"] <= window[1]]
    timed = inside if len(inside) >= 4 else steady
    hello, win, export_dir = st["hello"], st["windows"], st["export_dir"]
    p1 = statistics.median(r["phase1_end"] - r["phase1_start"] for r in timed)
    p2 = statistics.median(r["phase2_end"] - r["phase2_start"] for r in timed)
    busy = _busy_per_micro_batch(timed, win) if len(timed) > 1 else p1 + p2
    # CPU time per micro-batch, beside it: the median step of the running total
    cpu = (statistics.median(b["cpu_s"] - a["cpu_s"] for a, b in zip(timed, timed[1:]))
           if len(timed) > 1 and all("cpu_s" in r for r in timed) else None)
    scale = busy / (p1 + p2) if p1 + p2 > 0 and busy > 0 else 1.0
    eager = "eager-torch" in (hello.get("capabilities") or [])
    chunk = st["manifest"]["chunks"][0]
    return {
        "layers": st["layers"],
        "phase1_s": p1 * scale,  # the busy time, shared out as the phases' medians are
        "phase2_s": p2 * scale,
        "phase_median_s": [p1, p2], "busy_s": busy, "cpu_s": cpu, "timed_micro_batches": len(timed),
        # a step is a short sample, which a CPU budget's quota may or may not cut into; its CPU
        # time / share is what the window's step costs in a run
        "step_s": paced_busy_s(statistics.median(w["step_s"] for w in win),
                               statistics.median(w["step_cpu_s"] for w in win) if all("step_cpu_s" in w for w in win)
                               else None, hello.get("cpu_share")),
        "rss_peak_bytes": max([r.get("rss_peak_bytes") or 0 for r in st["mbs"]]
                              + [w.get("rss_peak_bytes") or 0 for w in win]),
        "pss_runtime_bytes": win[-1].get("pss_runtime_bytes"),
        "weights": _weight_bytes(export_dir, chunk, eager),
        "saved_activation_bytes": chunk["saved_activation_bytes"],
        "link_mbit": _push_rate(st["pushes"], export_dir, st["manifest"]),
    }


def _on_every_phone(handles: list, job) -> list:
    """job(index, handle) on every phone at once, one thread each; the results in the handles' order.
    The first phone that fails ends it with its ProfileError, once the others are done."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(len(handles), 1), thread_name_prefix="profile") as pool:
        futures = [pool.submit(job, i, h) for i, h in enumerate(handles)]
        return [f.result() for f in futures]


def calibration_counts(paces: list[float], reps: int, most: int = 8) -> list[int]:
    """Micro-batches per phone so that every phone computes about as long as the slowest one does
    in `reps` (at most `most` x reps): the phones are then timed side by side, all of them busy."""
    slowest = max(paces)
    return [min(most * reps, max(reps, math.ceil(reps * slowest / p))) + 1 if p > 0 else reps + 1 for p in paces]


def profile_devices(handles: list, cal: dict[int, Path], run_root: Path, reps: int = 4, links=None,
                    progress=None) -> list[dict]:
    """Profile every phone at once; the profiles in the handles' order.

    A short pass of the 1-layer program first tells how fast each phone is; then each calibration
    program runs on all phones together, the faster ones given more micro-batches so that all of
    them compute for about the same time, and each phone is timed (wall clock) only while all of
    them compute: in a run every stage is busy, and phones that share cores and caches (emulated
    ones on a CPU budget) run slower then, in CPU time per layer and in the share the kernel can
    give them, than a calibration measured alone or half alone says."""
    import dataclasses

    handles = [dataclasses.replace(h, restart=None) for h in handles]  # a phone that dies here is reported
    sizes = sorted(cal)
    first = sizes[0]
    pace = _on_every_phone(handles, lambda i, h: _calibration_stage(h, first, cal[first], run_root, reps + 1, links,
                                                                    progress, label="pace"))
    counts = calibration_counts([_busy_per_micro_batch(st["mbs"][1:], st["windows"]) if len(st["mbs"]) > 2 else 0.0
                                 for st in pace], reps)
    runs: list[dict[int, dict]] = [{} for _ in handles]
    hellos = [st["hello"] for st in pace]
    for n in sizes:
        stages = _on_every_phone(handles, lambda i, h: _calibration_stage(h, n, cal[n], run_root, counts[i], links,
                                                                          progress))
        window = _common_window(stages)
        for i, st in enumerate(stages):
            runs[i][n] = _stage_figures(st, window)
            if runs[i][n]["link_mbit"] is None and n == first:  # the files went to the phone in the first pass
                runs[i][n]["link_mbit"] = _push_rate(pace[i]["pushes"], cal[n], pace[i]["manifest"])
    return [build_profile(h.name, hellos[i], runs[i], cal[first]) for i, h in enumerate(handles)]


def paced_busy_s(wall_s: float, cpu_s: float | None, share: float | None) -> float:
    """A short sample's time as a long run will see it on a CPU budget: the kernel lets the process
    run `share` of each 10 ms period, so a busy stage advances at its CPU time / share, while one
    sample of a few periods may be held back at its quota or not almost at random. Without a
    budget (a real phone) the wall time is it."""
    if share and cpu_s:
        return cpu_s / share
    return wall_s


def _push_rate(pushes: list, export_dir: Path, manifest: dict) -> float | None:
    """Mbit/s of the largest file pushed (the time since the event before it), if any was sent."""
    sizes = {f["path"]: f["size"] for f in manifest["files"]}
    best = None
    for (t0, _), (t1, data) in zip(pushes, pushes[1:]):
        if data.get("sent") and data.get("file") in sizes and t1 > t0:
            size = sizes[data["file"]]
            if best is None or size > best[0]:
                best = (size, size * 8 / (t1 - t0) / 1e6)
    return None if best is None or best[0] < 1 << 16 else round(best[1], 1)  # a tiny file times the round trip


def build_profile(name: str, hello: dict, runs: dict[int, dict], export_dir: Path) -> dict:
    """Fit the per-layer and fixed costs from the calibration runs (pure: the numbers in, the profile out)."""
    n0, n1 = sorted(runs)
    a, b = runs[n0], runs[n1]
    dn = n1 - n0

    def fit(key):
        per = max((b[key] - a[key]) / dn, 0.0)
        return per, max(a[key] - n0 * per, 0.0)

    p1_layer, p1_fixed = fit("phase1_s")
    p2_layer, p2_fixed = fit("phase2_s")
    st_layer, st_fixed = fit("step_s")
    # the planner's cost: the two phases fitted together (each one alone can come out with a slope
    # below zero, clamped, when a budget's quota cuts a short phase at random)
    if "busy_s" in a and "busy_s" in b:
        mb_layer, mb_fixed = fit("busy_s")
    else:
        mb_layer = mb_fixed = None
    if p1_layer + p2_layer <= 0:  # timer noise swamped the difference: half fixed, half the layer's
        p1_layer, p2_layer = a["phase1_s"] / n0 / 2, a["phase2_s"] / n0 / 2
        p1_fixed, p2_fixed = a["phase1_s"] / 2, a["phase2_s"] / 2
    if mb_layer is None:  # a profile from phase times only
        mb_layer, mb_fixed = p1_layer + p2_layer, p1_fixed + p2_fixed
    elif mb_layer <= 0:
        mb_layer, mb_fixed = a["busy_s"] / n0 / 2, a["busy_s"] / 2
    wa, wb = a["weights"], b["weights"]
    layer_bytes = (wb["layers"] - wa["layers"]) // dn
    saved_layer = max((b["saved_activation_bytes"] - a["saved_activation_bytes"]) // dn, 0)
    # what a layer adds to the peak beyond its weights: the measured slope (program, arenas, saved
    # activations as the kernel counts them), never less than the export's saved activations
    act_layer = max((b["rss_peak_bytes"] - a["rss_peak_bytes"]) // dn - layer_bytes, saved_layer)
    runtime = a["pss_runtime_bytes"] or 0
    # everything the 1-layer stage's peak holds beyond runtime, weights and one layer's saved activations
    act_fixed = a["rss_peak_bytes"] - runtime - wa["readout"] - wa["embed"] - n0 * (layer_bytes + act_layer)
    manifest = json.loads((Path(export_dir) / "manifest.json").read_text())
    return {
        "format": PROFILE_FORMAT, "device": name, "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hello": {k: hello.get(k) for k in ("runtime_version", "os", "model", "cores", "memory_bytes",
                                            "memory_budget_bytes", "cpu_share", "capabilities")},
        "budget_bytes": hello.get("memory_budget_bytes") or hello.get("memory_bytes"),
        "export": {k: manifest["export"].get(k) for k in EXPORT_KEYS},
        "model_config": {k: manifest["model"]["config"][k] for k in ("hidden_size", "vocab_size")},
        "runs": {str(n): r for n, r in runs.items()},
        "fit": {"phase1_layer_s": p1_layer, "phase1_fixed_s": p1_fixed, "phase2_layer_s": p2_layer,
                "phase2_fixed_s": p2_fixed, "step_layer_s": st_layer, "step_fixed_s": st_fixed,
                "micro_batch_layer_s": mb_layer, "micro_batch_fixed_s": mb_fixed,
                "runtime_bytes": runtime, "readout_bytes": wa["readout"], "embed_bytes": wa["embed"],
                "layer_bytes": layer_bytes, "act_layer_bytes": act_layer, "act_fixed_bytes": act_fixed,
                "held_layer_bytes": saved_layer,
                "peak_1_layer_bytes": a["rss_peak_bytes"], "peak_more_layers_bytes": b["rss_peak_bytes"],
                "calibration_layers": [n0, n1]},
        "link_mbit": next((r["link_mbit"] for r in (b, a) if r["link_mbit"]), None),
    }


def phone_model(profile: dict, window_size: int, link_mbit: float | None = None,
                budget_bytes: int | None = None, scale: float = 1.0) -> PhoneModel:
    """The planner's view of a profiled phone: times per micro-batch (the window's AdamW step and
    checkpoint shared out over its micro-batches), `scale` x slower (a measured drift)."""
    f = profile["fit"]
    mb_layer = f.get("micro_batch_layer_s", f["phase1_layer_s"] + f["phase2_layer_s"])  # older profiles: phases
    mb_fixed = f.get("micro_batch_fixed_s", f["phase1_fixed_s"] + f["phase2_fixed_s"])
    per = (mb_layer + f["step_layer_s"] / window_size) * scale
    fixed = (mb_fixed + f["step_fixed_s"] / window_size) * scale
    return PhoneModel(name=profile["device"], layer_s=per, fixed_s=fixed,
                      link_mbit=link_mbit if link_mbit is not None else profile.get("link_mbit"),
                      budget_bytes=budget_bytes if budget_bytes is not None else profile.get("budget_bytes"),
                      runtime_bytes=f["runtime_bytes"], readout_bytes=f["readout_bytes"], embed_bytes=f["embed_bytes"],
                      layer_bytes=f["layer_bytes"], act_fixed_bytes=f["act_fixed_bytes"],
                      act_layer_bytes=f["act_layer_bytes"], held_layer_bytes=f["held_layer_bytes"])


def frame_bytes(profile: dict) -> int:
    """Bytes of one hidden state on a stage link: h (float32) plus mask, positions and labels (int64)."""
    e, c = profile["export"], profile["model_config"]
    return e["micro_batch"] * e["seq_len"] * (4 * c["hidden_size"] + 3 * 8)


# ---------------------------------------------------------------- files
def save_profile(profile: dict, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{profile['device']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(path)
    return path


def load_profiles(folder: Path, names: list[str] | None = None) -> list[dict]:
    """The profiles in `folder` (those of `names`, in that order, when given)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ProfileError(f"no profiles folder {folder}: run zl-host profile --devices ... --out {folder} first")
    found = {}
    for p in sorted(folder.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"{p} is not a readable profile ({e}); delete it and profile that phone again") from None
        if d.get("format") == PROFILE_FORMAT:
            found[d["device"]] = d
    if names is None:
        if not found:
            raise ProfileError(f"{folder} holds no profiles: run zl-host profile --devices ... --out {folder} first")
        return list(found.values())
    missing = [n for n in names if n not in found]
    if missing:
        raise ProfileError(f"no profile for {', '.join(missing)} in {folder} (have: {', '.join(found) or 'none'}): "
                           f"run zl-host profile --devices {','.join(missing)} --out {folder}")
    return [found[n] for n in names]


def check_matches(profiles: list[dict], export: dict) -> None:
    """Profiles measured at other settings than the run's do not predict it: refuse them."""
    for p in profiles:
        for k in ("seq_len", "micro_batch", "loss_positions", "backend", "base_weights"):
            if k in export and p["export"].get(k) != export[k]:
                raise ProfileError(f"{p['device']}'s profile was measured at {k} {p['export'].get(k)}, the run uses "
                                   f"{export[k]}: profile again with --{k.replace('_', '-')} {export[k]}")
