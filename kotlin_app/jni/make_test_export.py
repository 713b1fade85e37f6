"""A real two-chunk export for the Kotlin core's ExecuTorch tests (ExecuTorchBackendTest), and the
Python runtime's outputs on fixed inputs to check the JNI bridge against, bit for bit.

    python kotlin_app/jni/make_test_export.py OUT_DIR

OUT_DIR/export/ is zl-export's output for a 2-layer Llama (hidden 64, vocab 512) in chunks 0-0,1-1;
OUT_DIR/reference.safetensors holds, per chunk K, the inputs (`K/in/NAME`: every phase 1 input,
and the phase 2 inputs phase 1 does not produce) and the outputs (`K/phase1/NAME`, `K/phase2/NAME`)
of zl_common.program.ChunkProgram, i.e. ExecuTorch's Python bindings over the same libraries."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(out: Path) -> None:
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from exporter.config import ExportConfig
    from exporter.export import export_model
    from exporter.model_source import llama_config
    from exporter.tiny_tokenizer import build_tiny_tokenizer
    from zl_common.program import ChunkProgram

    torch.manual_seed(7)
    model_dir = out / "model"
    LlamaForCausalLM(llama_config(num_hidden_layers=2)).save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    cfg = ExportConfig(lora_rank=4, lora_alpha=8.0, seq_len=16, micro_batch=2, loss_positions=8, backend="xnnpack")
    export = out / "export"
    export_model(str(model_dir), "0-0,1-1", export, cfg, modes=("zerolock",))
    manifest = json.loads((export / "manifest.json").read_text())
    vocab = manifest["model"]["config"]["vocab_size"]
    g = torch.Generator().manual_seed(1234)
    ref = {}
    for chunk in manifest["chunks"]:
        k = chunk["index"]
        prog = ChunkProgram(export, chunk)
        values = {}
        for method in ("phase1", "phase2"):
            for spec in chunk["methods"][method]["inputs"]:
                name, shape, dtype = spec["name"], spec["shape"], spec["dtype"]
                if name in values or (method == "phase2" and any(o["name"] == name for o in chunk["methods"]["phase1"]["outputs"])):
                    continue
                if name == "input_ids":
                    v = torch.randint(0, vocab, shape, generator=g)
                elif name == "position_ids":
                    v = torch.arange(shape[-1]).expand(shape).contiguous()
                elif name == "attention_mask":
                    v = torch.ones(shape, dtype=torch.int64)
                elif name == "loss_index":
                    v = torch.randperm(cfg.micro_batch * cfg.seq_len, generator=g)[: shape[0]].sort().values
                elif name == "loss_target":
                    v = torch.randint(0, vocab, shape, generator=g)
                elif name == "loss_weight":
                    v = torch.full(shape, 1.0 / shape[0])
                elif name == "alpha":
                    v = torch.full(shape, 0.5)
                else:  # LoRA A and B (not B = 0: gradients of A must not vanish), h_in
                    v = torch.randn(shape, generator=g) * (1.0 if name == "h_in" else 0.05)
                assert str(v.dtype).removeprefix("torch.") == dtype, (name, v.dtype, dtype)
                values[name] = v
        p1 = prog.run("phase1", values)
        p2 = prog.run("phase2", {**values, **p1})
        ref.update({f"{k}/in/{n}": v for n, v in values.items()})
        ref.update({f"{k}/phase1/{n}": v.clone() for n, v in p1.items()})
        ref.update({f"{k}/phase2/{n}": v.reshape(v.shape if v.dim() else (1,)).clone() for n, v in p2.items()})
    save_file({n: v.contiguous() for n, v in ref.items()}, str(out / "reference.safetensors"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
