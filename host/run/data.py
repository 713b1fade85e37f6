"""The micro-batches a run trains on (and eval scores): the data spec read, checked and tokenised
with the export's own tokenizer at the export's shapes."""
from __future__ import annotations

from pathlib import Path

from ..cli.error import CliError


def prepare_data(export_dir: Path, manifest: dict, data: str | None, training: bool = True, warn=None):
    """Tokenised micro-batches of `data` for the program in `export_dir`; `warn(line)` hears about
    rejected rows and the truncation policy (default: printed to stderr)."""

    from zl_common.data import DataError, check_loss_positions, check_rejected, load_examples, tokenized_microbatches

    tok_dir = export_dir / "tokenizer"
    if not tok_dir.is_dir():
        raise CliError(f"{export_dir} has no tokenizer/ folder: export from a model directory with tokenizer files")
    tok = export_tokenizer(export_dir, manifest)
    if data is None and manifest["model"]["source"] != "tiny":
        raise CliError("--data FILE is required for this model (the built-in synthetic set matches only --model tiny)")
    try:
        examples = load_examples(data)
        warning = check_rejected(examples)  # most rows bad: refused; some: said, then trained on the rest
        if warning:
            (warn or _stderr)(f"zl-host: warning: {warning}")
        if any("messages" in ex for ex in examples):  # say which template renders the conversations
            (warn or _stderr)("zl-host: chat rows rendered with " + (
                "the tokenizer's own chat template" if getattr(tok, "chat_template", None) else
                "the fallback template (the tokenizer has none; zl_common/data/chat.py)"))
        e = manifest["export"]
        mbs = tokenized_microbatches(examples, tok, e["seq_len"], e["micro_batch"],
                                     say=lambda line: (warn or _stderr)(f"zl-host: truncation: {line}"))
        if training:  # a program never cuts a micro-batch's loss (eval reads the HF model's full logits)
            check_loss_positions(mbs, e["readout_rows"], e["micro_batch"])
    except DataError as err:
        raise CliError(str(err)) from None
    if not mbs:
        raise CliError(f"{data or 'the synthetic set'} gave no usable rows after tokenisation: check the file's format")
    return mbs


def export_tokenizer(export_dir: Path, manifest: dict):
    """The export's tokenizer, with the base model's chat template where the export's copy has none
    (an export copies tokenizer.json and tokenizer_config.json; transformers 5 keeps the template
    in chat_template.jinja beside them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export_dir / "tokenizer")
    if getattr(tok, "chat_template", None):
        return tok
    path = manifest["model"].get("path")
    if path:
        p = Path(path) if Path(path).is_absolute() else export_dir / path
        if (p / "chat_template.jinja").is_file():  # a GGUF's template comes with its tokenizer already
            tok.chat_template = (p / "chat_template.jinja").read_text()
    return tok


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)
