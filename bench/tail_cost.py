"""What issue 49's tail:D readout costs each chunk (phone) of SmolLM2-135M: CPU seconds per micro-batch
for its layers, readout and backward (chunk 0 also reads the embedding's p_{k-1}), and the frozen
layers it runs beside its own, for the default (tail:0, the lens) and each tail:D.

CPU time (one torch thread), not wall time: the number holds on a loaded shared machine. The eager
reference trainer's work (zl_mobile.reference through bench/quality.py's Trainer, the study's path), not an ExecuTorch program.

  nice -n 19 python bench/tail_cost.py --depths 0,2,10,all --micro-batches 4   # -> bench/results/tail_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import quality as Q  # noqa: E402
from bench.common import machine, now_iso  # noqa: E402


def method_of(depth: str) -> str:
    return "zl-last1-lens" if depth == "0" else ("zl-tailall" if depth == "all" else f"zl-tail{depth}-lens")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depths", default="0,2,10,all")
    p.add_argument("--micro-batches", type=int, default=4, help="timed micro-batches per depth (after one warm-up)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lens-rows", type=int, default=64, help="training rows the lenses are fitted on (cost only)")
    p.add_argument("--cache", default=os.environ.get("ZL_SMOLLM2_CACHE", "/tmp/zl_smollm2_fp32"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tail_cost.json"))
    p.add_argument("--render", metavar="JSON", help="only print the markdown table of a results file")
    a = p.parse_args(argv)
    if a.render:
        print(markdown(json.loads(Path(a.render).read_text())))
        return 0
    import torch

    from bench.quality_tasks import load_task

    torch.set_num_threads(1)
    depths = [d for d in a.depths.split(",") if d]
    base, tok = Q.load_base(Path(a.cache))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = a.micro_batch * (a.micro_batches + 1)
    data, _ = load_task("wordnet-reverse", tok, max(n, a.lens_rows), 1, 1, a.seq_len)
    mbs = Q.batches(data["train"], range(n), a.micro_batch, a.seq_len, pad)
    extra = sorted({e for d in depths for e in Q.tail_lens_boundaries(method_of(d))})
    lenses = Q.fit_lenses(base, Q.batches(data["train"], range(a.lens_rows), a.micro_batch, a.seq_len, pad), extra=extra)
    layers = base.config.num_hidden_layers
    per_layer = sum(p.numel() for p in base.model.layers[0].parameters())
    rows = []
    for d in depths:
        m = method_of(d)
        pm = Q.peft_model(base, 0)
        try:
            tr = Q.Trainer(pm, m, 1e-3, a.seq_len, a.micro_batch, lenses)
            tr.micro_batch(mbs[0], 0)  # warm-up, not counted
            tr.chunk_cpu = [0.0] * len(Q.CHUNKS)
            w0 = time.time()
            for i, b in enumerate(mbs[1:]):
                tr.micro_batch(b, i)
            wall = (time.time() - w0) / a.micro_batches
        finally:
            pm.unload()
        tail_layers = []
        for k in range(len(Q.CHUNKS)):
            first, last = Q.tail_span(k, "all" if d == "all" else int(d), layers)
            tail_layers.append(max(0, last - first + 1))
        first, last = Q.tail_span(-1, "all" if d == "all" else int(d), layers)
        rows.append({"depth": d, "method": m, "cpu_seconds_per_micro_batch": [c / a.micro_batches for c in tr.chunk_cpu],
                     "wall_seconds_per_micro_batch": wall, "tail_layers": tail_layers,
                     "embedding_tail_layers": max(0, last - first + 1),
                     "chunk_layers": [end - start + 1 for start, end in Q.CHUNKS]})
        print(f"tail:{d} ({m}): CPU s per micro-batch per chunk "
              + " / ".join(f"{c:.2f}" for c in rows[-1]["cpu_seconds_per_micro_batch"])
              + f"; tail layers {tail_layers} (+{rows[-1]['embedding_tail_layers']} for chunk 0's p_k-1)", flush=True)
    res = {"finished": now_iso(), "machine": machine(), "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
           "argv": sys.argv[1:] if argv is None else list(argv), "chunks": Q.CHUNKS, "params_per_layer": per_layer,
           "seq_len": a.seq_len, "micro_batch": a.micro_batch, "rows": rows}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


def markdown(res) -> str:
    """The cost table: CPU seconds per micro-batch per chunk, and the frozen layers each chunk's readout runs."""
    rows = res["rows"]
    base = next((r for r in rows if r["depth"] == "0"), None)
    k = len(res["chunks"])
    lines = ["| tail:D | CPU s per micro-batch, chunk " + " / ".join(map(str, range(k))) + " | vs tail:0 | "
             "frozen layers run beside the chunk's own (" + " / ".join(str(n) for n in rows[0]["chunk_layers"]) + ") |",
             "|---|---|---|---|"]
    for r in rows:
        c = r["cpu_seconds_per_micro_batch"]
        rel = " / ".join(f"{x / y:.2f}x" for x, y in zip(c, base["cpu_seconds_per_micro_batch"])) if base else "-"
        tl = list(r["tail_layers"])
        lines.append(f"| {r['depth']} | " + " / ".join(f"{x:.2f}" for x in c) + f" | {rel} | "
                     + " / ".join(str(x) for x in tl) + f" (chunk 0's p_k-1: +{r['embedding_tail_layers']}, forward only) |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
