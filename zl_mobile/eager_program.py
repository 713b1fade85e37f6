"""A chunk's two-phase training program in eager PyTorch (CPU threads or CUDA), behind the same
interface as zl_common.program.ChunkProgram: phase1, phase2 and run(method, values) with the
inputs and outputs the manifest names, for the ZeroLock program and the BP baseline stages.

The chunk is exporter.chunk_model's ChunkModel / BPChunkModel over a Llama that holds only the
chunk's layers, with the frozen weights of the export's chunk_k_weights.safetensors (zl-export
--eager-weights) and the model config the manifest records. Nothing here imports ExecuTorch.

Phase 1 runs the forward with the LoRA tensors as fresh leaves and keeps its autograd graph (the
saved tensors) in the returned `saved` dict under "_autograd"; phase 2 runs the readout and local
loss (ZeroLock), or takes dL/dh_k (BP), and back-propagates through that graph: the forward is
not recomputed. The LoRA values phase 2 is given are the ones phase 1 was given (every schedule
passes the same tensors, PipeDream its stashed copy); phase 2 uses phase 1's."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn

from zl_common.manifest import MANIFEST, Manifest, ManifestError
from zl_common.program import NamedMethods, ProgramError

GRAPH = "_autograd"  # key of phase 1's autograd state in the `saved` dict
EAGER_FIX = "re-export with zl-export --eager-weights (it writes chunk_k_weights.safetensors)"


@dataclass
class _Graph:
    """What phase 1 keeps for phase 2: the graph's input and output, and the LoRA leaves."""
    h_in: torch.Tensor          # the chunk's input hidden state (the embedding on chunk 0)
    h: torch.Tensor             # h_k, still attached to the graph
    leaves: list                # LoRA tensors (requires_grad), in self._order
    x_leaf: torch.Tensor | None  # BP, non-first chunk: h_{k-1} as a leaf, for dL/dh_{k-1}
    attn: tuple = ()            # the micro-batch's mask and rotary tables (a readout tail runs them)


class _Forward(nn.Module):
    """Phase 1 of a chunk as a module, so torch.func.functional_call can swap in the LoRA leaves."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x, attention_mask, position_ids):
        c = self.chunk
        h_in = c.embed_ids(x) if c.is_first else x
        attn = c.attention(h_in, attention_mask, position_ids)
        return h_in, c.run_layers(h_in, attention_mask, position_ids, attn=attn), attn


def check_torch_device(spec: str) -> torch.device:
    """`spec` as a torch.device this process can use; ValueError (one line, with the fix) if not."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"--torch-device {spec!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--torch-device {spec}: this torch ({torch.__version__}) sees no CUDA device: use "
                             "--torch-device cpu, or run on a machine with an NVIDIA GPU and a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--torch-device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0: use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise ValueError(f"--torch-device {spec}: only cpu and cuda are supported")
    return dev


def _export_config(export: dict):
    from exporter.config import ExportConfig

    known = {f.name for f in fields(ExportConfig)}
    kw = {k: v for k, v in export.items() if k in known}
    kw["target_modules"] = tuple(kw.get("target_modules", ()))
    return ExportConfig(**kw)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _build_chunk(weights: Path, hf_config: dict, cfg, first: int, last: int, bp_last: bool | None):
    """ChunkModel (bp_last None) or BPChunkModel over a Llama of only layers first..last, with the
    frozen weights from `weights` and peft LoRA (its values are given per call)."""
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from exporter.base_weights import adopt_stored, quantize_base
    from exporter.chunk_model import BPChunkModel, ChunkModel, lora_config
    from exporter.config import tail_depth, tail_end
    from exporter.readout_lens import from_tensors

    conf = LlamaConfig(**hf_config)
    # a ZeroLock chunk's readout tail (--readout tail:D) runs the layers after it too, at the base
    n_layers = hf_config["num_hidden_layers"]
    end = last if bp_last is not None else tail_end(last, tail_depth(cfg.readout, n_layers), n_layers)
    conf.num_hidden_layers = end - first + 1
    conf._attn_implementation = "eager"  # as exported: plain attention with the chunk's additive mask
    with torch.device("meta"):  # no memory and no random init for weights that are loaded next
        base = LlamaForCausalLM(conf)
        quantize_base(base, cfg.base_weights, cfg.decode_block_weights)  # the modules the export's weights were stored for
    stored = load_file(str(weights))
    lenses = from_tensors(stored)  # the readout lenses, if the export fitted them
    tensors = {}
    for name, t in stored.items():
        if name.startswith("readout_lens."):
            continue
        m = _LAYER.match(name)
        if m:  # the file keeps the full model's layer numbers
            name = f"model.layers.{int(m.group(1)) - first}.{m.group(2)}"
        tensors[name] = t
    adopt_stored(base, tensors)  # int4: Q4_0, or the GGUF's own Q4_1 / Q8_0 blocks
    base.load_state_dict(tensors, strict=False, assign=True)
    base.model.rotary_emb = type(base.model.rotary_emb)(config=conf)  # its tables are computed, not stored
    for p in base.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(base, lora_config(cfg))
    if bp_last is None:
        chunk = ChunkModel(peft_model, first, last, cfg, layer_offset=first, lenses=lenses,
                           num_layers=hf_config["num_hidden_layers"])
    else:
        chunk = BPChunkModel(peft_model, first, last, cfg, is_last=bp_last, layer_offset=first)
    missing = [n for n, t in [*chunk.named_parameters(), *chunk.named_buffers()] if t.is_meta]
    if missing:
        raise ProgramError(f"{weights.name} lacks weights chunk {first}-{last} needs ({missing[0]}, ...): {EAGER_FIX}")
    return chunk.eval()


class EagerChunkProgram(NamedMethods):
    def __init__(self, export_dir: Path, chunk: dict, device: str | torch.device = "cpu"):
        super().__init__(chunk)
        export_dir = Path(export_dir)
        self.device = torch.device(device)
        self.bp = "last" in chunk  # a BP stage's entry (ChunkEntry.for_mode("bp")) carries "last"
        if "eager_weights" not in chunk:
            raise ProgramError(f"the export has no eager-backend weights for chunk {self.index}: {EAGER_FIX}")
        weights = export_dir / chunk["eager_weights"]
        if not weights.is_file():
            raise ProgramError(f"{weights.name} is not on this device: push it (the host sends it to eager-backend "
                               f"phones), or {EAGER_FIX}")
        try:
            manifest = Manifest.from_json(json.loads((export_dir / MANIFEST).read_text()))
            hf_config = manifest.model["hf_config"]
            cfg = _export_config(manifest.export)
        except (OSError, ValueError, KeyError, ManifestError) as e:
            raise ProgramError(f"cannot read the model config from {export_dir / 'manifest.json'} "
                               f"({type(e).__name__}: {e}): {EAGER_FIX}") from None
        first, last = chunk["layers"]
        self.first_input = chunk["first_input"]
        self.module = _build_chunk(weights, hf_config, cfg, first, last, chunk["last"] if self.bp else None)
        self.module.to(self.device)
        self._forward = _Forward(self.module)
        from exporter.chunk_model import peft_name

        local = {peft_name(n, first): n for n in self.module.lora_parameters()}
        if set(local) != set(self.lora_names):
            raise ProgramError(f"chunk {self.index}: the eager model's LoRA tensors do not match the manifest's: "
                               "the export and this zl_mobile disagree; re-export with this version")
        self._order = [(g, "chunk." + local[g]) for g in self.lora_names]

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu")

    def _check(self, method: str, values: dict, names) -> None:
        """The inputs this backend reads, by the manifest's names and shapes (as ExecuTorch checks them)."""
        specs = {s["name"]: s for s in self.methods[method]["inputs"]}
        for n in names:
            t = values.get(n)
            if t is None:
                raise ProgramError(f"{method} of chunk {self.index} needs input {n!r}, which was not given")
            if n in specs and list(t.shape) != specs[n]["shape"]:
                raise ProgramError(f"{method} input {n!r} has shape {list(t.shape)}, the program was "
                                   f"exported for {specs[n]['shape']}: pad the micro-batch or re-export")

    def run(self, method: str, values: dict) -> dict:
        if method == "phase1":
            return self._phase1(values)
        if method == "phase2":
            return self._bp_backward(values) if self.bp else self._local_backward(values)
        raise ProgramError(f"chunk {self.index} has no method {method!r}: phase1 or phase2")

    def _phase1(self, values: dict) -> dict:
        self._args("phase1", values)  # every input the exported phase1 takes, with its shape
        leaves = [self._to(values[g]).detach().clone().requires_grad_(True) for g, _ in self._order]
        x = self._to(values[self.first_input])
        x_leaf = None
        if self.bp and not self.module.is_first:  # dL/dh_{k-1} is the gradient w.r.t. this input
            x = x_leaf = x.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            h_in, h, attn = torch.func.functional_call(
                self._forward, {name: leaf for (_, name), leaf in zip(self._order, leaves)},
                (x, self._to(values["attention_mask"]), self._to(values["position_ids"])))
        return {"h_out": self._out(h), GRAPH: _Graph(h_in, h, leaves, x_leaf, attn)}

    def _graph(self, method: str, values: dict) -> _Graph:
        g = values.get(GRAPH)
        if not isinstance(g, _Graph):
            raise ProgramError(f"{method} of chunk {self.index} needs the `saved` of its phase1 "
                               "(the eager backend keeps the forward's graph there)")
        return g

    def _grads(self, g: _Graph, outputs, grad_outputs=None) -> dict:
        inputs = ([g.x_leaf] if g.x_leaf is not None else []) + g.leaves
        grads = torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs)
        out = {}
        if g.x_leaf is not None:
            out["grad_h_in"], grads = self._out(grads[0]), grads[1:]
        out.update({"grad:" + name: self._out(t) for (name, _), t in zip(self._order, grads)})
        return out

    def _local_backward(self, values: dict) -> dict:
        """ZeroLock phase 2: readout and local loss on h_k, LoRA gradients through phase 1's graph."""
        names = ("loss_index", "loss_target", "loss_weight", "alpha")
        self._check("phase2", values, names)
        g = self._graph("phase2", values)
        idx, tgt, w, alpha = (self._to(values[n]) for n in names)
        with torch.enable_grad():
            loss, task, consis = self.module.local_loss(g.h_in, g.h, idx, tgt, w, alpha, g.attn)
            grads = self._grads(g, loss)
        return {"loss": self._out(loss), "task_loss": self._out(task), "consis_loss": self._out(consis), **grads}

    def _bp_backward(self, values: dict) -> dict:
        """BP phase 2: from the global loss (last stage) or dL/dh_k (grad_h_out) to dL/dh_{k-1} and LoRA grads."""
        g = self._graph("phase2", values)
        with torch.enable_grad():
            if self.module.is_last:
                names = ("loss_index", "loss_target", "loss_weight")
                self._check("phase2", values, names)
                loss = self.module.global_loss(g.h, *(self._to(values[n]) for n in names))
                return {"loss": self._out(loss), **self._grads(g, loss)}
            self._check("phase2", values, ("grad_h_out",))
            return self._grads(g, g.h, self._to(values["grad_h_out"]))
