"""A deterministic word-level tokenizer for the built-in tiny model and the synthetic data.

Lowercase normalizer, whitespace/punctuation pre-tokenizer, WordLevel model. Ids:
``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3, then the synthetic dataset's words in sorted
order. Like Llama's tokenizer it prepends ``<s>`` when ``add_special_tokens=True`` and never
appends ``</s>``. Round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from zl_common.data.synthetic import synthetic_vocabulary

# vocab_size of the built-in tiny model; the tokenizer may use fewer ids.
TINY_VOCAB_SIZE = 512

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0, 1, 2, 3


def tiny_vocab() -> dict[str, int]:
    """token -> id: the four special tokens, then the synthetic words, sorted."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in synthetic_vocabulary():
        vocab.setdefault(word, len(vocab))
    if len(vocab) > TINY_VOCAB_SIZE:
        raise ValueError(f"tiny tokenizer needs {len(vocab)} ids but the tiny model has "
                         f"vocab_size={TINY_VOCAB_SIZE}; shrink the synthetic word lists")
    return vocab


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny word-level tokenizer (same vocabulary and ids on every call)."""
    vocab = tiny_vocab()
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        padding_side="right",
        clean_up_tokenization_spaces=False)
