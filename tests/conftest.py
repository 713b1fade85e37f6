"""Shared fixtures: a small Llama (3 layers) written as a HF directory and exported once per
session in three chunks, so tests that need real programs share one export. The suite runs in
pytest-xdist workers (scripts/test.sh): the costly session fixtures are built once for all
workers (`shared_once`), and each test module stays on one worker (`--dist loadfile`: its module-scoped
fixtures are built once, the README runner's commands run in order)."""
from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", category=DeprecationWarning)


def _bind_library_logging_to_session_stderr():
    """transformers makes its log handler on first use, bound to the sys.stderr of that moment: if
    that is inside a test using capsys, the handler keeps the test's stream, closed once the test
    ends, and a later test's warning prints a "Logging error" traceback into its own stderr. Made
    here, the handler holds the session's stream whichever module a worker runs first."""
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")


_bind_library_logging_to_session_stderr()

SMALL_LAYERS = 3
SMALL_DECODE_BLOCK = 6144  # weights decoded at once in the small int4 export: the MLP's 8,192 in 2 row blocks
SMALL_CHUNKS = "0-0,1-1,2-2"  # three one-layer chunks: three emulated phones


def shared_once(tmp_path_factory, name: str, build):
    """build(dir) run once per test session even across xdist workers: the first worker to ask builds
    it in a directory every worker sees, under a file lock, and pickles its value; the others wait for
    the lock and load that value. Without xdist it is a plain session cache."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the per-run directory all workers' base temps sit in
    here = root / f"shared-{name}"
    done = here / "value.pickle"
    with FileLock(str(here) + ".lock"):
        if done.exists():
            return pickle.loads(done.read_bytes())
        here.mkdir(exist_ok=True)
        value = build(here)
        part = here / "value.pickle.part"
        part.write_bytes(pickle.dumps(value))
        part.rename(done)  # a worker that dies mid-write leaves no half value for the others
        return value


def matmul_flops(ep) -> int:
    """FLOPs of the matmuls (mm, bmm, addmm) in an exported program's graph."""
    total = 0
    for n in ep.graph.nodes:
        if n.op == "call_function" and any(k in str(n.target) for k in ("aten.mm", "aten.bmm", "aten.addmm")):
            a, b = [x.meta["val"] for x in n.args[-2:]]
            total += 2 * a.numel() * b.shape[-1]
    return total


def small_export_config(**kw):
    from exporter.config import ExportConfig

    base = dict(lora_rank=4, lora_alpha=8.0, seq_len=16, micro_batch=2, loss_positions=8, backend="portable")
    base.update(kw)
    return ExportConfig(**base)


def write_small_model_dir(path: Path, layers: int = SMALL_LAYERS) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    from exporter.model_source import llama_config
    from exporter.tiny_tokenizer import build_tiny_tokenizer

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config(num_hidden_layers=layers)).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> Path:
    return shared_once(tmp_path_factory, "small_model", lambda d: write_small_model_dir(d / "model"))


@pytest.fixture(scope="session")
def small_export(small_model_dir, tmp_path_factory):
    """(out_dir, manifest, artifacts, cfg) of the small model exported in three chunks (ZeroLock and
    BP programs, and the frozen weights the eager backend reads)."""
    from exporter.export import export_model

    def build(d):
        cfg = small_export_config()
        manifest, artifacts = export_model(str(small_model_dir), SMALL_CHUNKS, d / "out", cfg,
                                           modes=("zerolock", "bp"), eager_weights=True)
        return d / "out", manifest, artifacts, cfg

    return shared_once(tmp_path_factory, "small_export", build)


@pytest.fixture(scope="session")
def small_export_tail(small_model_dir, tmp_path_factory):
    """The small model in the same three chunks with --readout tail:1 (portable): chunk 0's tail
    ends mid-model (a lens after layer 1), chunk 1's at the top (the final norm), chunk 2 has
    none; with the eager backend's weights. (out_dir, manifest, artifacts, cfg). Not shared_once:
    the lens fit leaves transformers' output hooks on the layers, which do not pickle; only
    tests/test_readout_tail.py uses it (one xdist group)."""
    from exporter.export import export_model

    cfg = small_export_config(readout="tail:1")
    out = tmp_path_factory.mktemp("export_tail") / "out"
    manifest, artifacts = export_model(str(small_model_dir), SMALL_CHUNKS, out, cfg, eager_weights=True)
    return out, manifest, artifacts, cfg


def _quantized_export(base_weights, small_model_dir, tmp_path_factory, **cfg_kw):
    from exporter.export import export_model

    def build(d):
        cfg = small_export_config(base_weights=base_weights, backend="xnnpack", **cfg_kw)
        manifest, artifacts = export_model(str(small_model_dir), SMALL_CHUNKS, d / "out", cfg,
                                           modes=("zerolock", "bp"), eager_weights=True)
        return d / "out", manifest, artifacts, cfg

    return shared_once(tmp_path_factory, f"small_export_{base_weights}", build)


@pytest.fixture(scope="session")
def small_export_int8(small_model_dir, tmp_path_factory):
    """The same small model and chunks with int8 base weights (--base-weights int8), lowered to
    XNNPACK as phones run it: (out_dir, manifest, artifacts, cfg)."""
    return _quantized_export("int8", small_model_dir, tmp_path_factory)


def as_gguf_blocks(w, kind: str):
    """w's values as a GGUF of type `kind` ("Q4_1", "Q8_0") holds them (what transformers loads)."""
    import torch
    from gguf import GGMLQuantizationType, quants

    t = getattr(GGMLQuantizationType, kind)
    return torch.from_numpy(quants.dequantize(quants.quantize(w.detach().numpy(), t), t))


@pytest.fixture(scope="session")
def small_model_dir_gguf_blocks(small_model_dir, tmp_path_factory) -> Path:
    """The small model with the weights a quantized GGUF would give: layer 1's Linears Q4_1 values,
    the embedding and lm_head Q8_0 values (SmolLM2's file: Q4_1, its tied embedding Q8_0); the
    rest floats."""
    import torch

    from exporter.model_source import load_model_dir
    from exporter.tiny_tokenizer import build_tiny_tokenizer

    def build(d):
        out = d / "model"
        model = load_model_dir(small_model_dir)
        with torch.no_grad():
            for lin in model.model.layers[1].modules():
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.copy_(as_gguf_blocks(lin.weight, "Q4_1"))
            for w in (model.model.embed_tokens.weight, model.lm_head.weight):
                w.copy_(as_gguf_blocks(w, "Q8_0"))
        model.save_pretrained(out)
        build_tiny_tokenizer().save_pretrained(out)
        return out

    return shared_once(tmp_path_factory, "small_model_gguf_blocks", build)


@pytest.fixture(scope="session")
def small_export_int4(small_model_dir_gguf_blocks, tmp_path_factory):
    """The same with int4 base weights (--base-weights int4), lowered to XNNPACK, from the small
    model with a GGUF's blocks in places: Q4_0 blocks, layer 1's Q4_1, the embedding's and the
    readout's Q8_0. Decoded in row blocks as a larger model's are (6,144 weights at once: the MLP
    weights in 2 uneven blocks, lm_head in 6); the int8 export decodes each weight whole."""
    return _quantized_export("int4", small_model_dir_gguf_blocks, tmp_path_factory, decode_block_weights=SMALL_DECODE_BLOCK)


def small_micro_batches(export_dir: Path, n_examples: int = 8, micro_batch: int = 2, seq_len: int = 16):
    """Synthetic-task micro-batches tokenised with the export's tokenizer."""
    from transformers import AutoTokenizer

    from zl_common.data import encode_examples, load_examples, make_microbatches

    tok = AutoTokenizer.from_pretrained(export_dir / "tokenizer")
    examples = load_examples(None)[:n_examples]
    return make_microbatches(encode_examples(examples, tok, seq_len), micro_batch, seq_len, tok.pad_token_id)


def run_pipeline(export_dir: Path, root: Path, settings, micro_batches, n_phones: int = 3, on_event=None,
                 phone_args=None, network=None, phones_out: list | None = None):
    """host.phones.emulate.run_on_emulated_phones with the tests' defaults: this process's phone names, run
    id "test", a run that hangs ended after 300 s (a failed test, not a stalled CI). Returns (result,
    metrics records)."""
    import os

    from host.phones.emulate import run_on_emulated_phones

    if settings.max_seconds is None:
        settings.max_seconds = 300
    return run_on_emulated_phones(export_dir, root, settings, micro_batches, n_phones, prefix=f"t{os.getpid()}-",
                                  run_id="test", extra_args=phone_args, network=network, on_event=on_event,
                                  phones_out=phones_out)


def build_bpe_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer (GPT-2 style, as SmolLM2's) trained on the synthetic set: real
    merges, so a GGUF file can carry it the way llama.cpp writes one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from zl_common.data.synthetic import synthetic_examples

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([e["prompt"] + e["completion"] for e in synthetic_examples(200, seed=1)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")


def write_gguf_llama(path: Path, layers: int = 2, tied: bool = True, seed: int = 11):
    """A small random Llama with tied embeddings (as SmolLM2) and its BPE tokenizer, written as a
    GGUF file with the gguf package. Returns (path, the model as written)."""
    import torch
    from transformers import LlamaForCausalLM

    from exporter.gguf_model import write_llama_gguf
    from exporter.model_source import llama_config

    tok = build_bpe_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(num_hidden_layers=layers, vocab_size=len(tok), tie_word_embeddings=tied,
                                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.pad_token_id)).eval()
    return write_llama_gguf(model, tok, path), model


@pytest.fixture(scope="session")
def gguf_llama(tmp_path_factory):
    """(path, model) of a 2-layer random Llama stored as GGUF (tied embeddings, BPE tokenizer)."""
    return shared_once(tmp_path_factory, "gguf_llama", lambda d: write_gguf_llama(d / "tiny-llama.gguf"))


def cli_error_line(capsys) -> str:
    """The one `zl-host: error:` line a refused command printed (and that it printed only one)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("zl-host: error:")]
    assert len(lines) == 1, err
    return lines[0]


def sealed_frame(sock, frame: bytes) -> bytes:
    """A hand-built (plain) frame as the record layer of `sock`'s session sends it (PROTOCOL.md 6.1):
    tests that send broken or partial frames after the handshake build them with this, since a
    plain frame there is refused for its flags alone before anything else is looked at."""
    import struct
    import zlib

    from zl_mobile.protocol.frames import SEALED_FLAG, encode_header
    from zl_mobile.protocol.seal import TAG_BYTES, seal_of

    body = frame[16:-4]
    header = encode_header(frame[5], len(body) + TAG_BYTES, flags=SEALED_FLAG)
    ct = seal_of(sock).seal(header, body)
    return header + ct + struct.pack("<I", zlib.crc32(ct))
