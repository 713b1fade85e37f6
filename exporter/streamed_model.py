"""A Hugging Face Llama directory read one tensor at a time, each frozen weight stored as the
export's --base-weights as soon as it is read, so the model is never whole in fp32.

transformers' from_pretrained builds the whole model in fp32 first: Llama-3.2-3B's shape is 12.8 GB
that way, more than the exporter may take on a 24 GiB machine, while its int4 base is 1.9 GB. Here
the model is built on the meta device (no memory, no random init), and each layer is read from the
safetensors in fp32, runs the readout lens's calibration text if the export fits lenses (they are
fitted on the fp32 model, as before: readout_lens.fit_lenses goes layer by layer), then is stored
as int8 / int4 (base_weights.quantize_base) before the next is read. The embedding and lm_head
are stored last (the embedding feeds the calibration text in). The result is the model
from_pretrained + quantize_base would give, tensor for tensor (tests/test_streamed_model.py)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from .errors import ModelDirError

_FIX = "check that config.json and the weights belong together, or fetch the model files again"


class _WeightFiles:
    """Which safetensors file holds each tensor. Each read opens its file anew: safetensors maps
    the file, and every page a read touched would stay in this process's resident set for as long
    as the file stays open (Llama-3.2-3B: +200 MiB a layer, all 6 GiB of the file by the end)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        self.where = {}
        for f in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                self.where.update((k, f) for k in st.keys())

    def _key(self, name: str) -> str | None:
        # a checkpoint of the bare LlamaModel names its tensors without the "model." prefix
        for key in (name, name.removeprefix("model.")):
            if key in self.where:
                return key
        return None

    def fp32(self, name: str, shape: torch.Size) -> torch.Tensor:
        key = self._key(name)
        if key is None:
            raise ModelDirError(f"{self.path}: no tensor {name} in its *.safetensors: {_FIX}")
        from safetensors import safe_open

        with safe_open(str(self.where[key]), framework="pt") as st:
            t = st.get_tensor(key)
        if tuple(t.shape) != tuple(shape):
            raise ModelDirError(f"{self.path}: {name} is {tuple(t.shape)} in the weights, config.json makes it "
                                f"{tuple(shape)}: {_FIX}")
        return t.to(torch.float32)


def dir_config(path: Path):
    """The LlamaConfig of the model directory at `path` (checked), as the export builds the model:
    eager attention (plain aten ops), fp32."""
    from transformers import LlamaConfig

    from .model_source import check_model_dir

    check_model_dir(path)
    conf = LlamaConfig.from_pretrained(path, local_files_only=True)
    conf._attn_implementation = "eager"
    conf.dtype = torch.float32  # what from_pretrained(torch_dtype=float32) records
    return conf


def read_model_dir(path: Path, base_weights: str = "fp32", block_weights: int | None = None,
                   lens_after=(), batches=None, progress=None):
    """(model, lenses, positions): the LlamaForCausalLM (eager attention) at `path` with its
    frozen Linears and embedding stored as `base_weights`, and, when `lens_after` names
    boundaries, the readout lenses there fitted on `batches` (readout_lens.fit_lenses; else {}, 0).
    `progress(done, total)` after each layer read."""
    from transformers import LlamaForCausalLM

    from . import readout_lens
    from .base_weights import quantize_base
    from .config import DECODE_BLOCK_WEIGHTS

    block_weights = block_weights or DECODE_BLOCK_WEIGHTS
    conf = dir_config(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(conf)
    core = model.model
    core.rotary_emb = type(core.rotary_emb)(config=conf)  # computed tables, not weights
    files = _WeightFiles(path)
    _load(core.embed_tokens, "model.embed_tokens", files)
    _load(core.norm, "model.norm", files)

    def layers():
        for i, layer in enumerate(core.layers):
            _load(layer, f"model.layers.{i}", files)
            yield layer  # fp32 while the lens fit runs it
            quantize_base(layer, base_weights, block_weights)
            if progress and not lens_after:
                progress(i + 1, len(core.layers))

    if lens_after:
        lenses, positions = readout_lens.fit_lenses(core, layers(), batches, lens_after, progress=progress)
    else:
        for _ in layers():
            pass
        lenses, positions = {}, 0
    if conf.tie_word_embeddings:  # one tensor, as from_pretrained ties them (a quantized base stores each apart)
        model.lm_head.weight = core.embed_tokens.weight
    else:
        _load(model.lm_head, "lm_head", files)
    quantize_base(model, base_weights, block_weights)  # the embedding and lm_head: the layers' are stored already
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelDirError(f"{path}: no weights for {left[0]}" + (f" and {len(left) - 1} more" if len(left) > 1 else "")
                            + f": {_FIX}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), lenses, positions


def _load(module: nn.Module, prefix: str, files: _WeightFiles) -> None:
    """Give `module`'s (meta) parameters their fp32 values from the files."""
    for name, p in list(module.named_parameters(recurse=True)):
        owner, _, leaf = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        setattr(target, leaf, nn.Parameter(files.fp32(f"{prefix}.{name}", p.shape), requires_grad=False))
