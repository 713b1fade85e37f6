"""Every chunk's readout on held-out rows; delta_k: how far a chunk's readout is from the
exact optimum of its local loss (the seed's Proposition 1).

delta_k = KL(p_k || p_k*) at the label position, p_k* the minimiser over the probability simplex of
alpha * CE(p, y) + (1 - alpha) * KL(p || p_{k-1}). That optimum keeps p_{k-1}'s shape off the label
and moves mass t onto it: p*(y) = t, p*(l) = (1 - t) q_l / (1 - q_y), t found per position by bisection.
exact_match scores a generative task: greedy generation against the expected text.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .readouts import StaticReadout, causal_lm


def _local_optimum_t(q_y, alpha, iters=60):
    """t = p*(y) minimising -alpha log t + (1-alpha) KL((t, (1-t) q_rest) || q) over t in (q_y, 1)."""
    lo, hi = q_y.clone(), torch.ones_like(q_y)
    for _ in range(iters):
        t = (lo + hi) / 2
        d = -alpha / t + (1 - alpha) * (torch.log(t / q_y) - torch.log((1 - t).clamp(min=1e-30) / (1 - q_y)))
        lo, hi = torch.where(d < 0, t, lo), torch.where(d < 0, hi, t)
    return (lo + hi) / 2


def delta_k(logp, logq, y, alpha=0.5):
    """KL(p_k || p_k*) per position, p_k* the exact minimiser of the local loss given p_{k-1} = q."""
    q = logq.exp()
    q_y = q.gather(1, y[:, None]).squeeze(1).clamp(1e-12, 1 - 1e-7)
    t = _local_optimum_t(q_y, alpha)
    # log p*: log t at y, log((1-t) q_l / (1 - q_y)) elsewhere
    log_star = logq + (torch.log1p(-t) - torch.log1p(-q_y))[:, None]
    log_star = log_star.scatter(1, y[:, None], torch.log(t)[:, None])
    p = logp.exp()
    return (p * (logp - log_star)).sum(-1)


def _t(b, k):
    return torch.from_numpy(b[k])


@torch.no_grad()
def evaluate(pm_or_base, mbs, label_ids, chunks, readout=None) -> dict:
    """Per chunk readout ({"chunk_k": ...}): answer NLL over the answer tokens, label accuracy (the
    argmax over the vocabulary at the label position), choice accuracy (the argmax among
    `label_ids`), delta_k at the label position (alpha = 0.5). The last chunk's is the full model's."""
    llama = causal_lm(pm_or_base)
    head = llama.lm_head
    readout = readout or StaticReadout(llama)
    K = len(chunks)
    sums = {k: {"nll": 0.0, "tokens": 0, "label_ok": 0, "choice_ok": 0, "rows": 0, "delta": 0.0} for k in range(K)}
    cand = torch.tensor(label_ids)
    for b in mbs:
        labels = _t(b, "labels")
        valid = labels != -100
        if not valid.any():
            continue
        out = llama.model(input_ids=_t(b, "input_ids"), attention_mask=_t(b, "attention_mask"),
                          output_hidden_states=True)
        hs = out.hidden_states  # [embedding, layer 0 out, ..., final (normed)]
        # the label position of each row: its first valid position
        first = torch.zeros_like(valid)
        rows = valid.any(1)
        first[rows, valid[rows].float().argmax(1)] = True
        y_all, y_lab = labels[valid], labels[first]
        att, pos = _t(b, "attention_mask"), (_t(b, "position_ids") if "position_ids" in b else None)
        prev_lab = F.log_softmax(head(readout.read(-1, hs[0], first, att, pos)), dim=-1)
        for k, (_, last) in enumerate(chunks):
            is_final = k == K - 1
            u = (lambda sel: hs[-1][sel]) if is_final else \
                (lambda sel, h=hs[last + 1], k=k: readout.read(k, h, sel, att, pos))
            logp_all = F.log_softmax(head(u(valid)), dim=-1)
            logp_lab = F.log_softmax(head(u(first)), dim=-1)
            s = sums[k]
            s["nll"] += float(-logp_all.gather(1, y_all[:, None]).sum())
            s["tokens"] += int(valid.sum())
            s["label_ok"] += int((logp_lab.argmax(-1) == y_lab).sum())
            if len(cand):  # a generative task has no label set to choose among
                s["choice_ok"] += int((cand[logp_lab[:, cand].argmax(-1)] == y_lab).sum())
            s["rows"] += int(first.sum())
            s["delta"] += float(delta_k(logp_lab, prev_lab, y_lab).sum())
            prev_lab = logp_lab
    return {f"chunk_{k}": {"answer_nll": s["nll"] / max(s["tokens"], 1), "label_accuracy": s["label_ok"] / max(s["rows"], 1),
                           "choice_accuracy": s["choice_ok"] / max(s["rows"], 1), "delta_k": s["delta"] / max(s["rows"], 1),
                           "rows": s["rows"]} for k, s in sums.items()}


MAX_NEW_TOKENS = 12  # the longest two-word WordNet lemma is well under this many tokens


def normalise(text: str) -> str:
    return " ".join(text.split())


@torch.no_grad()
def exact_match(model, tok, rows, seq_len, batch=16, max_new_tokens=MAX_NEW_TOKENS) -> dict:
    """Greedy generation after each row's prompt (tokenised as in training: bos + prompt, cut on the
    left to leave room for the answer), stopped at eos; exact match of the whitespace-normalised
    text against the completion. Returns the rate and a few (expected, generated) samples."""
    from zl_common.data.batching import _prompt_and_answer_ids

    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    prompts = []
    for r in rows:
        p, _ = _prompt_and_answer_ids(tok, r["prompt"], r["completion"])
        prompts.append(bos + p[max(0, len(bos) + len(p) - (seq_len - max_new_tokens)):])
    hits, samples = 0, []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk])  # left padding: generation continues each row
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)
        for j, row in enumerate(rows[i:i + batch]):
            gen = out[j, L:].tolist()
            gen = gen[:gen.index(eos)] if eos in gen else gen
            text = normalise(tok.decode(gen, skip_special_tokens=True))
            ok = text == normalise(row["completion"])
            hits += ok
            if len(samples) < 8:
                samples.append([normalise(row["completion"]), text])
    return {"exact_match": hits / max(len(rows), 1), "rows": len(rows), "samples": samples}
