"""Training data: the synthetic set, AG News / JSONL loaders, tokenisation, micro-batches."""

from .batching import (
                       IGNORE_INDEX,
                       Encoded,
                       EncodedList,
                       check_loss_positions,
                       encode_examples,
                       make_microbatches,
                       tokenized_microbatches,
                       truncation_summary,
)
from .chat import FALLBACK_CHAT_TEMPLATE, chat_ids, generation_prompt, render_chat
from .examples import DataError, LoadedExamples, check_rejected
from .loaders import DEFAULT_SYNTHETIC_N, ag_news_example, clean_ag_text, load_ag_news_csv, load_examples, load_jsonl
from .synthetic import LABELS, format_completion, format_prompt, synthetic_examples, synthetic_vocabulary
from .wordnet import DEFAULT_CATEGORIES, load_wordnet, wordnet_splits

__all__ = [
    "IGNORE_INDEX", "Encoded", "EncodedList", "check_loss_positions", "encode_examples", "make_microbatches",
    "tokenized_microbatches", "truncation_summary", "FALLBACK_CHAT_TEMPLATE", "chat_ids", "generation_prompt",
    "render_chat",
    "DEFAULT_SYNTHETIC_N", "DataError", "LoadedExamples", "ag_news_example", "check_rejected", "clean_ag_text",
    "load_ag_news_csv", "load_examples", "load_jsonl",
    "LABELS", "format_completion", "format_prompt", "synthetic_examples",
    "synthetic_vocabulary", "DEFAULT_CATEGORIES", "load_wordnet", "wordnet_splits",
]
