"""One ZeroLock training run in eager PyTorch: each chunk trains its LoRA on its own local loss.

For every micro-batch, chunk by chunk (k = 0..K-1), on the previous chunk's detached output:

    h_k      = chunk k's layers (h_{k-1}.detach())
    p_k      = log_softmax(lm_head(readout(k, h_k)))          at the answer positions
    loss_k   = alpha_k * CE(p_k, y) + (1 - alpha_k) * KL(p_k || p_{k-1}.detach())
    loss_k.backward()                                          # reaches chunk k's LoRA only

then, as a stage does, the window's gradients are the token-weighted mean over its micro-batches
(zl_mobile.accumulate.WindowGradients) and zl_mobile.adamw.AdamW steps them. With `alphas=None`
the trainer is the backprop baseline: the global CE at the final head through the whole model.

With no readout of its own the chunks run as exporter.chunk_model.ChunkModel, the module zl-export
traces into the phones' programs (the eager backend runs the same module), so this path is the
programs' arithmetic; a readout (lens, tail, adapter) runs the same loss in plain autograd.
"""
from __future__ import annotations

import re
import time

import torch
import torch.nn.functional as F

from zl_mobile.adamw import AdamW, AdamWConfig


def lora_params(pm) -> dict:
    """The peft model's LoRA tensors by name: what ZeroLock trains."""
    return {n: p for n, p in pm.named_parameters() if "lora_" in n}


def chunk_of(name: str, chunks) -> int:
    """The chunk (index into `chunks`, [(first, last)]) whose layer a LoRA parameter's name says it is in."""
    layer = int(re.search(r"\blayers\.(\d+)\.", name).group(1))
    return next(k for k, (first, last) in enumerate(chunks) if first <= layer <= last)


def _t(b, k):
    return torch.from_numpy(b[k])


class ReferenceTrainer:
    """Micro-batches in, LoRA updated in place: ZeroLock's local losses (or backprop's global one),
    the token-level window mean and zl_mobile's AdamW.

    pm: a peft LoRA model of a Llama; chunks: [(first, last)] layer ranges; alphas: one per chunk
    (None: backprop); readout: None (the programs' ChunkModel path, one alpha for all chunks) or a
    readouts.* object, whose own parameters() train along; lr_scales: an LR factor per chunk (0 leaves
    that chunk's LoRA as it starts); weight_decay: AdamW's (zl_mobile.adamw's default; zl-host run's is 0)."""

    def __init__(self, pm, chunks, lr, seq_len, micro_batch, alphas=None, readout=None, lr_scales=None,
                 weight_decay=AdamWConfig.weight_decay):
        from exporter.chunk_model import ChunkModel
        from exporter.config import ExportConfig
        from zl_mobile.accumulate import WindowGradients

        self.pm, self.chunks, self.readout = pm, tuple(chunks), readout
        self.alphas = None if alphas is None else tuple(alphas)
        if self.alphas is not None and len(self.alphas) != len(self.chunks):
            raise ValueError(f"{len(self.alphas)} alphas for {len(self.chunks)} chunks: give one per chunk")
        self.params = lora_params(pm)
        if readout is not None:
            self.params.update(readout.parameters())
        self.data = {n: p.data for n, p in self.params.items()}
        self.acc = WindowGradients(self.data)
        self.lr_scales = tuple(lr_scales) if lr_scales is not None else (1.0,) * len(self.chunks)
        if lr_scales is None:
            self.opt = [AdamW(self.data, AdamWConfig(lr=lr, weight_decay=weight_decay))]
        else:  # one optimizer per chunk, at its own LR; none where it is 0
            groups = {}
            for n in self.data:
                groups.setdefault(chunk_of(n, self.chunks), {})[n] = self.data[n]
            self.opt = [AdamW(g, AdamWConfig(lr=lr * self.lr_scales[k], weight_decay=weight_decay))
                        for k, g in sorted(groups.items()) if self.lr_scales[k] > 0]
        if self.alphas is not None:
            cfg = ExportConfig(seq_len=seq_len, micro_batch=micro_batch, alpha=self.alphas[0])
            self.chunk_models = [ChunkModel(pm, first, last, cfg) for first, last in self.chunks]
        self.first_losses = None
        # CPU seconds per chunk (its layers, readout and backward; the plain-autograd path): the phone's
        # share of a micro-batch, so a deeper readout's cost shows per chunk whatever the machine's load
        self.chunk_cpu = [0.0] * len(self.chunks)

    def micro_batch(self, b, window) -> dict:
        """One micro-batch (numpy arrays: input_ids, attention_mask, position_ids, labels) into the
        window's gradients; returns its losses (task_k, consis_k per chunk; task_K-1 for backprop)."""
        for p in self.params.values():
            p.grad = None
        n_valid = float((b["labels"] != -100).sum())
        if self.alphas is None:
            losses = self._backprop(b)
        elif self.readout is not None:
            losses = self._zerolock_autograd(b)
        else:
            losses = self._zerolock_programs(b)
        self.acc.add(window, {n: p.grad for n, p in self.params.items() if p.grad is not None}, n_valid)
        if self.first_losses is None:
            self.first_losses = losses
        return losses

    def end_window(self, window):
        """The window's mean gradient, one optimizer step."""
        grads = self.acc.mean(window)
        for opt in self.opt:
            opt.step({n: grads[n] for n in opt.params})

    def _backprop(self, b) -> dict:
        """BP: global CE at the final head, through the whole model."""
        llama = self.pm.base_model.model
        h = llama.model(input_ids=_t(b, "input_ids"), attention_mask=_t(b, "attention_mask")).last_hidden_state
        valid = _t(b, "labels") != -100
        logp = F.log_softmax(llama.lm_head(h[valid]), dim=-1)
        loss = F.nll_loss(logp, _t(b, "labels")[valid])
        loss.backward()
        return {f"task_{len(self.chunks) - 1}": float(loss.detach())}

    def _zerolock_autograd(self, b) -> dict:
        """ZeroLock with the readout's own read (adapter, lens or tail), in plain autograd."""
        llama = self.pm.base_model.model
        valid = _t(b, "labels") != -100
        y = _t(b, "labels")[valid]
        x, att, pos = _t(b, "input_ids"), _t(b, "attention_mask"), _t(b, "position_ids")
        losses = {}
        c0 = time.process_time()  # chunk 0's share: the embedding and its p_{k-1} too
        h_in = llama.model.embed_tokens(x)
        with torch.no_grad():  # p_{-1}: the embedding read out, chunk 0's KL target
            logq = F.log_softmax(llama.lm_head(self.readout.read(-1, h_in, valid, att, pos)), dim=-1)
        for k, ch in enumerate(self.chunk_models):
            c0 = c0 if k == 0 else time.process_time()
            h = ch.run_layers(h_in, att, pos)
            logp = F.log_softmax(llama.lm_head(self.readout.read(k, h, valid, att, pos)), dim=-1)
            ce = F.nll_loss(logp, y)
            kl = (logp.exp() * (logp - logq)).sum(-1).mean()
            if self.lr_scales[k] > 0:
                (self.alphas[k] * ce + (1 - self.alphas[k]) * kl).backward()
            losses[f"task_{k}"], losses[f"consis_{k}"] = float(ce.detach()), float(kl.detach())
            logq, h_in = logp.detach(), h.detach()  # the next chunk's p_{k-1} and input: no gradient back
            self.chunk_cpu[k] += time.process_time() - c0
        return losses

    def _zerolock_programs(self, b) -> dict:
        """ZeroLock through ChunkModel's forward, the programs' module: its loss is the local loss
        with the static readout, at the positions the stage gathers (zl_mobile.readout)."""
        from zl_mobile.readout import readout_positions

        labels = b["labels"]
        index, target, weight, dropped = readout_positions(labels, labels.size)
        assert dropped == 0
        x = _t(b, "input_ids")
        assert len(set(self.alphas)) == 1, "per-chunk alpha runs with a readout of its own (the plain-autograd path)"
        a = torch.tensor([self.alphas[0]])
        losses = {}
        for k, ch in enumerate(self.chunk_models):
            loss, task, consis, x = ch(x, _t(b, "attention_mask"), _t(b, "position_ids"),
                                       torch.from_numpy(index), torch.from_numpy(target),
                                       torch.from_numpy(weight), a)
            loss.backward()
            losses[f"task_{k}"], losses[f"consis_{k}"] = float(task), float(consis)
        return losses
