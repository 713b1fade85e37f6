"""AdamW over named tensors, step for step the same arithmetic as torch.optim.AdamW
(single-tensor path). Kept here rather than using torch.optim so the state is plain tensors
the stage can checkpoint, send and restore exactly; ExecuTorch ships SGD only."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


class AdamW:
    def __init__(self, params: dict[str, torch.Tensor], cfg: AdamWConfig = AdamWConfig()):
        self.params = params  # updated in place
        self.cfg = cfg
        self.step_count = 0
        self.exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        missing = set(self.params) - set(grads)
        if missing:
            raise ValueError(f"AdamW step without gradients for {sorted(missing)[:3]}")
        c = self.cfg
        b1, b2 = c.betas
        self.step_count += 1
        t = self.step_count
        bias1 = 1 - b1 ** t
        bias2_sqrt = (1 - b2 ** t) ** 0.5
        step_size = c.lr / bias1
        for n, p in self.params.items():
            g = grads[n]
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            p.mul_(1 - c.lr * c.weight_decay)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / bias2_sqrt).add_(c.eps)
            p.addcdiv_(m, denom, value=-step_size)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"exp_avg/{n}": t for n, t in self.exp_avg.items()}
        out.update({f"exp_avg_sq/{n}": t for n, t in self.exp_avg_sq.items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        for n in self.params:
            self.exp_avg[n] = tensors[f"exp_avg/{n}"].clone()
            self.exp_avg_sq[n] = tensors[f"exp_avg_sq/{n}"].clone()
        self.step_count = step_count
