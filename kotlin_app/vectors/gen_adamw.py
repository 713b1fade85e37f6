"""Generate AdamW reference vectors from torch.optim.AdamW for the Kotlin core's tests.

Run from the repository root with the project venv:
    . .venv/bin/activate && python kotlin_app/vectors/gen_adamw.py
Writes kotlin_app/vectors/adamw.json. Each case: hyper-parameters, initial parameter values and,
per step, the gradient fed in and the parameter / exp_avg / exp_avg_sq after the step. All
float32; values are written with repr() of the float32 converted to Python float (exact).
"""
from __future__ import annotations

import json
import pathlib

import torch

OUT = pathlib.Path(__file__).with_name("adamw.json")

CASES = [
    # name, lr, betas, eps, weight_decay, n, steps, seed
    ("defaults", 1e-3, (0.9, 0.999), 1e-8, 1e-2, 17, 6, 0),
    ("lora_typical", 2e-4, (0.9, 0.999), 1e-8, 0.0, 33, 8, 1),
    ("big_lr_wd", 5e-2, (0.9, 0.95), 1e-6, 0.1, 9, 7, 2),
    ("strong_wd", 1e-2, (0.8, 0.99), 1e-8, 0.5, 12, 5, 3),
    ("tiny_grads", 1e-3, (0.9, 0.999), 1e-8, 1e-2, 10, 6, 4),
]


def floats(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.detach().to(torch.float32).reshape(-1).tolist()]


def make_case(name, lr, betas, eps, wd, n, steps, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float32))
    init = floats(p)
    # foreach=False, fused=False: the single-tensor CPU path, i.e. what a reader of the docs expects.
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd,
                            foreach=False, fused=False)
    out_steps = []
    scale = 1e-6 if name == "tiny_grads" else 1.0
    for _ in range(steps):
        grad = torch.randn(n, generator=g, dtype=torch.float32) * scale
        if n > 4:
            grad[3] = 0.0  # a zero gradient element
        p.grad = grad.clone()
        opt.step()
        st = opt.state[p]
        out_steps.append({
            "grad": floats(grad),
            "param": floats(p),
            "exp_avg": floats(st["exp_avg"]),
            "exp_avg_sq": floats(st["exp_avg_sq"]),
            "step": int(st["step"]),
        })
    return {"name": name, "lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps,
            "weight_decay": wd, "init": init, "steps": out_steps}


def main() -> None:
    doc = {"torch_version": torch.__version__,
           "generator": "kotlin_app/vectors/gen_adamw.py",
           "cases": [make_case(*c) for c in CASES]}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({len(doc['cases'])} cases, torch {torch.__version__})")


if __name__ == "__main__":
    main()
