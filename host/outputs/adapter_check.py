"""zl-host eval's checks of an adapter against its base model and program, before peft sees it.

peft loads a mismatched adapter with a warning, or none, and the eval then reports the base
model's numbers as the adapter's; a torn file gives a traceback. Each problem here is one line
naming the file and the fix. The base model is built on the meta device: shapes, no weights."""
from __future__ import annotations

import json
import re
from pathlib import Path

_KEY = re.compile(r"base_model\.model\.(.+)\.(lora_[AB])\.weight\Z")


class AdapterError(ValueError):
    """One line: what is wrong with the adapter (or base model) and what to do."""


def base_weights_present(base: Path) -> None:
    if base.is_file():  # a GGUF base is its own weights file (its existence is checked by the caller)
        return
    if not any(base.glob("*.safetensors")) and not any(base.glob("pytorch_model*.bin")):
        raise AdapterError(f"the base model dir {base} has no weights file (*.safetensors): restore the model "
                           "files the export was made from (no model hub is asked)")


def check_adapter(adapter: Path, base: Path, manifest_lora: dict | None = None) -> None:
    cfg = _read_config(adapter)
    tensors = _read_shapes(adapter)
    r, targets = cfg["r"], cfg["targets"]
    linears = _base_linears(base)
    seen: dict[str, set] = {}
    for key, shape in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise AdapterError(f"{adapter}/adapter_model.safetensors holds {key!r}, not a LoRA weight of a "
                               "peft adapter: pass the adapter/ folder a zl-host run wrote")
        module, ab = m.groups()
        if module not in linears:
            raise AdapterError(f"{adapter} has LoRA for {module}, which the base model {base} does not have: "
                               "the adapter belongs to another model")
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in targets:
            raise AdapterError(f"{adapter} has LoRA for {leaf} but its adapter_config.json targets "
                               f"{', '.join(sorted(targets))}: the config and the weights do not belong together")
        out_f, in_f = linears[module]
        want = (r, in_f) if ab == "lora_A" else (out_f, r)
        if tuple(shape) != want:
            have_r = shape[0] if ab == "lora_A" else shape[-1]
            raise AdapterError(f"{adapter}: {module}.{ab} is {list(shape)}, expected {list(want)} "
                               + (f"(rank {have_r}, but adapter_config.json says r={r})" if have_r != r else
                                  f"(the base model's {leaf} is {in_f}->{out_f})")
                               + ": the adapter and its config or base model do not belong together")
        seen.setdefault(module, set()).add(ab)
    expected = sorted(m for m in linears if m.rsplit(".", 1)[-1] in targets)
    missing = [m for m in expected if seen.get(m) != {"lora_A", "lora_B"}]
    if not expected or missing:
        raise AdapterError(f"{adapter} has LoRA for {len(expected) - len(missing)} of the {len(expected)} "
                           f"{'/'.join(sorted(targets))} layers of the base model"
                           + (f" (missing e.g. {missing[0]})" if missing else "")
                           + ": it was trained for other target modules or another model")
    if manifest_lora is not None:  # a sound adapter, but for another export of this model
        want_r, want_t = manifest_lora.get("rank"), set(manifest_lora.get("target_modules") or [])
        if (want_r, want_t) != (r, targets):
            raise AdapterError(f"{adapter} is a rank-{r} adapter for {', '.join(sorted(targets))}, but this program "
                               f"was exported with rank {want_r} for {', '.join(sorted(want_t))}: evaluate it with "
                               "the --program it was trained on")


def _read_config(adapter: Path) -> dict:
    path = adapter / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path} is unreadable ({e}): pass the adapter/ folder a zl-host run wrote") from None
    r, targets = cfg.get("r") if isinstance(cfg, dict) else None, cfg.get("target_modules") if isinstance(cfg, dict) else None
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or not isinstance(targets, list) or not targets \
            or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path}: r must be a positive integer and target_modules a list of module names "
                           f"(got r={r!r}, target_modules={targets!r}); pass the adapter/ folder a zl-host run wrote")
    return {"r": r, "targets": set(targets)}


def _read_shapes(adapter: Path) -> dict:
    from safetensors import safe_open

    path = adapter / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterError(f"{adapter} has no adapter_model.safetensors: pass the adapter/ folder a zl-host run wrote")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for a torn or foreign file
        raise AdapterError(f"{path} is not a readable safetensors file "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                           "the adapter is corrupt or incomplete; copy it again or re-run zl-host run") from None


def _base_linears(base: Path) -> dict[str, tuple[int, int]]:
    """module path -> (out_features, in_features) of every Linear in the base model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if base.is_file():  # a GGUF file: transformers reads the config from its metadata
            config = AutoConfig.from_pretrained(str(base.parent), gguf_file=base.name, local_files_only=True)
        else:
            config = AutoConfig.from_pretrained(str(base), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # a bad config.json: transformers raises many types
        raise AdapterError(f"the base model's config in {base} cannot be read ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}): "
                           "restore the model files the export was made from") from None
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}
