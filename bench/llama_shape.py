"""A Llama of a published shape with random weights, written as an ordinary Hugging Face directory
(config.json, bf16 safetensors shards and their index, a tokenizer): what zl-export reads for the
shapes no test model has (issue 53: Llama-3.2-3B's over four to six phones).

One tensor is made at a time and each shard written when it is full, so the writer holds one shard
(at most --shard-gib) and one tensor however large the model: the 3B shape's 6.0 GiB were written in
37 s at a peak RSS of 2.6 GiB.
Weights are N(0, initializer_range) as transformers initializes a Llama (norms 1); the tokenizer is
the tests' tiny one (its ids are a prefix of the shape's vocabulary, so every id has a row).
Llama 3.2's "llama3" RoPE scaling is left out: it changes positions past 8,192, far beyond what a
phone trains on.

  python bench/llama_shape.py --shape llama-3.2-3b --out /tmp/llama-3.2-3b-shape
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
                           max_position_embeddings=2048, rms_norm_eps=1e-5),
}


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Llama of `config` saves (a tied lm_head is not saved)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def write_shape(out: Path, config, seed: int = 0, shard_bytes: int = 2 << 30, say=print) -> dict:
    """Write `config`'s Llama with random bf16 weights under `out`, shard by shard. Returns
    {"tensors", "bytes", "shards", "seconds", "peak_rss_bytes"}."""
    import torch
    from safetensors.torch import save_file

    from exporter.tiny_tokenizer import build_tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    total = sum(2 * _numel(s) for s in shapes.values())
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    shard: dict[str, torch.Tensor] = {}
    shard_size, names, weight_map, written = 0, [], {}, 0
    n_shards = max(1, -(-total // shard_bytes))  # a first guess, for the file names; fixed up below

    def flush():
        nonlocal shard, shard_size, written
        if not shard:
            return
        name = f"model-{len(names) + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        written += shard_size
        say(f"  {written / 2**30:6.2f} / {total / 2**30:.2f} GiB written (shard {len(names)}, {time.time() - t0:.0f} s)")
        shard, shard_size = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, config.initializer_range, generator=gen)
            t = t.to(torch.bfloat16)
        size = 2 * t.numel()
        if shard and shard_size + size > shard_bytes:
            flush()
        shard[name] = t
        shard_size += size
    flush()
    if len(names) != n_shards:  # the guess was off: the names must say the real count
        for i, old in enumerate(names):
            new = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
            (out / old).rename(out / new)
            weight_map = {k: (new if v == old else v) for k, v in weight_map.items()}
            names[i] = new
    if len(names) == 1:
        (out / names[0]).rename(out / "model.safetensors")
    else:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return {"tensors": len(shapes), "bytes": total, "shards": len(names), "seconds": time.time() - t0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shape_config(shape: str, **overrides):
    from transformers import LlamaConfig

    from exporter.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return LlamaConfig(**{**SHAPES[shape], **overrides}, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gib", type=float, default=2.0, help="the most a shard holds (and the writer at once)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers of the same widths (to probe one chunk's "
                   "export quickly)")
    a = p.parse_args(argv)
    from zl_common.quiet import quiet_libraries

    quiet_libraries()  # the terminal shows the writer's progress, not torchao's or transformers' notices
    if a.out.exists() and any(a.out.iterdir()):
        print(f"{a.out} is not empty: give a new --out (nothing was written)", file=sys.stderr)
        return 2
    cfg = shape_config(a.shape, **({"num_hidden_layers": a.layers} if a.layers else {}))
    print(f"writing {a.shape}{f' ({a.layers} layers)' if a.layers else ''} (random bf16) to {a.out}")
    r = write_shape(a.out, cfg, a.seed, int(a.shard_gib * 2**30))
    print(f"{r['tensors']} tensors, {r['bytes'] / 2**30:.2f} GiB in {r['shards']} shard(s), {r['seconds']:.0f} s, "
          f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
