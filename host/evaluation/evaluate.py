"""zl-host eval: held-out accuracy and NLL of the final chunk's readout (the full model's
logits) with the trained adapter, in eager PyTorch on the HF model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def evaluate(model_dir: str, adapter_dir: Path | None, micro_batches: list[dict], base_weights: str = "fp32",
             progress=None) -> dict:
    """`model_dir`: the base model, a HF directory or a GGUF file (host.outputs.adapter.base_model_path).
    `base_weights`: the export's (manifest "export"): an adapter trained on an int8 base is
    evaluated on the same int8 base. `progress(done, total)`, if given, after loading (done 0)
    and after each micro-batch."""
    from peft import PeftModel

    from exporter.base_weights import quantize_base
    from exporter.model_source import load_base_model

    model = load_base_model(model_dir)
    quantize_base(model, base_weights)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    nll_sum, correct, count = 0.0, 0, 0
    if progress is not None:
        progress(0, len(micro_batches))
    with torch.no_grad():
        for i, b in enumerate(micro_batches):
            if progress is not None and i:
                progress(i, len(micro_batches))
            ids = torch.from_numpy(b["input_ids"])
            labels = torch.from_numpy(b["labels"])  # already shifted: labels[i] is the target at position i
            logits = model(input_ids=ids, attention_mask=torch.from_numpy(b["attention_mask"])).logits
            valid = labels != -100
            if not valid.any():
                continue
            logp = torch.log_softmax(logits[valid], dim=-1)
            tgt = labels[valid]
            nll_sum += float(-logp.gather(1, tgt[:, None]).sum())
            correct += int((logp.argmax(-1) == tgt).sum())
            count += int(valid.sum())
    if progress is not None:
        progress(len(micro_batches), len(micro_batches))
    if count == 0:
        raise ValueError("the evaluation data has no answer tokens: check the dataset")
    return {"nll": nll_sum / count, "accuracy": correct / count, "tokens": count}


def split_held_out(micro_batches: list, fraction: float = 0.2) -> tuple[list, list]:
    """(train, held out): the last `fraction` of the micro-batches (at least one) held out; 0: none."""
    if fraction == 0:
        return micro_batches, []
    n = max(1, int(len(micro_batches) * fraction))
    return micro_batches[:-n] or micro_batches, micro_batches[-n:]


def logits_change(model_dir: str, adapter_dir: Path, batch: dict) -> float:
    """Largest change of the logits the adapter makes on one batch (it must not be a no-op)."""
    from peft import PeftModel

    from exporter.model_source import load_base_model

    base = load_base_model(model_dir)
    ids = torch.from_numpy(np.asarray(batch["input_ids"]))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        after = tuned(input_ids=ids).logits
    return float((after - before).abs().max())
