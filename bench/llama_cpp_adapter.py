"""The exported GGUF adapter checked by its real consumer: llama.cpp (through its Python binding,
llama-cpp-python, compiled here from its PyPI sdist; the wheel is cached in
bench/results/llama_cpp_work/wheel/) against peft on the same base, on held-out prompts.

For each prompt: the next-token logits at the answer position and the greedy answer (8 tokens) from
  peft    the base (the GGUF dequantized to fp32 by transformers) + the run's PEFT adapter
  lcpp+A  llama.cpp on the base GGUF as it is (e.g. Q4_1) + `zl-host export --gguf`'s adapter.gguf
  lcpp    llama.cpp on the base GGUF without the adapter
  merged  llama.cpp on `zl-host export --merged`'s merged.gguf (f16), unless --no-merged
and, as the floor the base's own quantization sets, peft's base model against lcpp.

    python bench/llama_cpp_adapter.py --run RUN [--data wordnet:test] [--prompts 32]
    python bench/llama_cpp_adapter.py --synthetic smollm2 [--data wordnet:test]

RUN is a zl-host run on a GGUF base (e.g. the demo's SmolLM2: zl-export --model smollm2).
--synthetic BASE (a GGUF file or smollm2) needs no run: a PEFT adapter with random A and B on
q_proj, k_proj, v_proj and o_proj (rank 8, alpha 16), so the k rows' permutation (SmolLM2: 9 query
heads, 3 kv heads) and every target's layout are exercised; the prompts are tokenised with the
base's own tokenizer."""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench.common  # noqa: E402,F401  (quiet libraries, SIGTERM unwinds)

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
WHEEL_DIR = ROOT / "bench/results/llama_cpp_work/wheel"  # git-ignored (bench/results/*_work/)
# CPU only and without llama.cpp's tools, server and tests: what the binding needs, in ~25 min on 2 cores
CMAKE_ARGS = ("-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF "
              "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF "
              "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_MTMD=OFF")


def ensure_llama_cpp():
    """import llama_cpp; if missing, install the cached wheel, building it from the sdist first if needed."""
    try:
        import llama_cpp  # noqa: F401
        return llama_cpp
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(WHEEL_DIR / "llama_cpp_python-*.whl")))
    if not wheels:
        print(f"building {LLAMA_CPP_PYTHON} from its PyPI sdist (compiles llama.cpp; cached in {WHEEL_DIR}) ...",
              flush=True)
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
                        LLAMA_CPP_PYTHON, "-w", str(WHEEL_DIR)], check=True,
                       env={**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())})
        wheels = sorted(glob.glob(str(WHEEL_DIR / "llama_cpp_python-*.whl")))
    # --no-deps: its dependencies (numpy, typing-extensions, diskcache, jinja2) must not move the project's pins
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", wheels[-1]], check=True)
    for dep in ("diskcache", "jinja2"):
        if subprocess.run([sys.executable, "-c", f"import {dep}"], capture_output=True).returncode:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", dep], check=True)
    import llama_cpp
    return llama_cpp


def synthetic_adapter(spec: str, out: Path, seed: int = 0, std: float = 0.05):
    """(base GGUF path, a PEFT adapter dir with random A and B on q/k/v/o, the base's tokenizer)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from exporter.gguf_model import SMOLLM2, load_gguf_tokenizer, smollm2_path
    from exporter.model_source import load_base_model

    base = smollm2_path() if spec == SMOLLM2 else Path(spec).absolute()
    model = load_base_model(str(base))
    with warnings.catch_warnings():  # peft expects a HF directory: a GGUF base is renamed and has no config.json
        warnings.filterwarnings("ignore", category=UserWarning, module=r"peft(\.|$)")
        pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                              lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                              base_model_name_or_path=str(base)))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        pm.save_pretrained(str(out))
    return base, out, load_gguf_tokenizer(base)


def synthetic_prompts(tok, data: str, n: int):
    """[(prompt ids, expected answer ids)] of the first n examples of `data`, as the runs tokenise them."""
    from zl_common.data import load_examples
    from zl_common.data.batching import _prompt_and_answer_ids

    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []  # [bos] + prompt, as encode_examples
    out = []
    for e in list(load_examples(data))[:n]:
        p, c = _prompt_and_answer_ids(tok, e["prompt"], e["completion"])
        out.append((bos + p, c))
    return out


class LlamaCpp:
    """llama.cpp on one GGUF (with an adapter or not): logits at the last prompt position, greedy answers."""

    def __init__(self, llama_cpp, model: Path, lora: Path | None = None, n_ctx: int = 256, threads: int = 1):
        # threads: ggml's workers spin at barriers, so on a loaded machine 1 thread beats 2 by far
        self.llm = llama_cpp.Llama(model_path=str(model), lora_path=str(lora) if lora else None, n_ctx=n_ctx,
                                   logits_all=True, n_threads=threads, verbose=False, seed=0)

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[len(ids) - 1], dtype=np.float64)

    def greedy(self, ids: list[int], n: int, eos: int | None) -> list[int]:
        self.llm.reset()
        self.llm.eval(ids)
        out = []
        for _ in range(n):
            t = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            if t == eos:
                break
            out.append(t)
            self.llm.eval([t])
        return out


def peft_side(base: str, adapter: Path, prompts, eos, n_new: int):
    """(logits, answers) of peft's base and adapter model per prompt (fp32, eager attention)."""
    import torch
    from peft import PeftModel

    from exporter.model_source import load_base_model
    from host.evaluation.answers import _greedy

    model = PeftModel.from_pretrained(load_base_model(base), str(adapter)).eval()
    res = {"peft": ([], []), "peft_base": ([], [])}
    with torch.no_grad():
        for ids, _ in prompts:
            x = torch.tensor([ids])
            for name in res:
                if name == "peft_base":
                    with model.disable_adapter():
                        lg, ans = model(input_ids=x).logits[0, -1], _greedy(model, x, n_new, eos)
                else:
                    lg, ans = model(input_ids=x).logits[0, -1], _greedy(model, x, n_new, eos)
                res[name][0].append(lg.double().numpy())
                res[name][1].append(ans)
    return res


def compare(a_logits, b_logits, a_ans, b_ans) -> dict:
    """How far two sides agree: largest |logit difference|, mean KL(a||b) of the next token, top-1
    and whole-answer agreement."""
    maxdiff, kls, top1 = 0.0, [], 0
    for a, b in zip(a_logits, b_logits):
        maxdiff = max(maxdiff, float(np.abs(a - b).max()))
        pa, pb = _softmax(a), _softmax(b)
        kls.append(float((pa * (np.log(pa + 1e-30) - np.log(pb + 1e-30))).sum()))
        top1 += int(a.argmax() == b.argmax())
    n = len(a_logits)
    return {"max_abs_logit_diff": maxdiff, "mean_kl": float(np.mean(kls)), "top1_agree": top1 / n,
            "answers_agree": sum(x == y for x, y in zip(a_ans, b_ans)) / n}


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a zl-host run directory on a GGUF base")
    src.add_argument("--synthetic", metavar="BASE", help="a GGUF file or smollm2: a random adapter on it, no run")
    p.add_argument("--data", default="wordnet:test", help="held-out data (as zl-host eval --data)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--no-merged", action="store_true", help="skip the merged GGUF")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (1 on a busy machine)")
    p.add_argument("--out", default=str(ROOT / "bench/results/llama_cpp_adapter.json"))
    a = p.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"

    from transformers import AutoTokenizer

    from host.cli.export import resolve_run
    from host.evaluation.answers import prompts_and_answers
    from host.outputs.gguf_adapter import write_gguf_adapter
    from host.run.data import prepare_data

    t0 = time.time()
    llama_cpp = ensure_llama_cpp()
    if a.run:
        run = Path(a.run)
        adapter, program, manifest, base = resolve_run(run)
        if not base.is_file():
            raise SystemExit(f"{run}'s base {base} is a HF directory: this bench needs a run on a GGUF base (llama.cpp reads it)")
        lora = manifest.get("lora")
        tok = AutoTokenizer.from_pretrained(program / "tokenizer")
        prompts = prompts_and_answers(prepare_data(program, manifest, a.data, training=False), a.prompts)
    else:
        run = ROOT / "bench/results/llama_cpp_work/synthetic"
        base, adapter, tok = synthetic_adapter(a.synthetic, run / "adapter")
        lora, program = None, None
        prompts = synthetic_prompts(tok, a.data, a.prompts)
    out_dir = run / "export"
    gguf_adapter = write_gguf_adapter(adapter, base, out_dir / "adapter.gguf", lora)
    eos = tok.eos_token_id
    print(f"{len(prompts)} held-out prompts from {a.data}; base {base.name}", flush=True)

    sides = peft_side(str(base), adapter, prompts, eos, a.new_tokens)
    gguf_files = {"lcpp+A": (base, gguf_adapter), "lcpp": (base, None)}
    if not a.no_merged:
        from host.outputs.merged_model import merged_model, write_merged_gguf

        merged = write_merged_gguf(merged_model(adapter, base, lora), base, program and program / "tokenizer",
                                   out_dir / "merged.gguf")
        gguf_files["merged"] = (merged, None)
    print(f"peft done ({time.time() - t0:.0f} s)", flush=True)
    for name, (model, lora) in gguf_files.items():
        ll = LlamaCpp(llama_cpp, model, lora, threads=a.threads)
        sides[name] = ([ll.logits(ids) for ids, _ in prompts], [ll.greedy(ids, a.new_tokens, eos) for ids, _ in prompts])
        del ll
        print(f"{name} done ({time.time() - t0:.0f} s)", flush=True)

    def acc(name):  # greedy answer starts with the expected label word (the answer's first token)
        return sum(ans[:1] == exp[:1] for ans, (_, exp) in zip(sides[name][1], prompts)) / len(prompts)

    pairs = [("lcpp+A", "peft"), ("lcpp", "peft_base"), ("lcpp", "peft"), ("lcpp+A", "peft_base")]
    if "merged" in sides:
        pairs.insert(1, ("merged", "peft"))
    result = {"run": str(run), "base": str(base), "adapter_gguf": str(gguf_adapter), "data": a.data,
              "prompts": len(prompts), "llama_cpp_python": llama_cpp.__version__,
              "first_token_accuracy": {n: acc(n) for n in sides},
              "pairs": {f"{x} vs {y}": compare(sides[x][0], sides[y][0], sides[x][1], sides[y][1]) for x, y in pairs},
              "examples": [{"prompt": tok.decode(ids, skip_special_tokens=True)[-80:],
                            "expected": tok.decode(exp, skip_special_tokens=True),
                            **{n: tok.decode(sides[n][1][i], skip_special_tokens=True) for n in sides}}
                           for i, (ids, exp) in enumerate(prompts[:4])],
              "seconds": time.time() - t0}
    Path(a.out).write_text(json.dumps(result, indent=2))
    print("| sides | max abs logit diff | mean KL (next token) | top-1 agree | greedy answers agree |")
    print("|---|---|---|---|---|")
    for k, v in result["pairs"].items():
        print(f"| {k} | {v['max_abs_logit_diff']:.3f} | {v['mean_kl']:.2e} | {v['top1_agree']:.2f} | {v['answers_agree']:.2f} |")
    print("first-token accuracy: " + ", ".join(f"{n} {v:.2f}" for n, v in result["first_token_accuracy"].items()))
    print(f"written {a.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
