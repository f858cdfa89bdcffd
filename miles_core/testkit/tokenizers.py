"""Save a real HF tokenizer (character level) next to a tiny checkpoint, without any hub access."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import transformers

ROLE_TAG_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
"""A chat template for tests: each message as ``<initial of its role>content``, then ``<a>`` (needs ``<`` and ``>``
in the alphabet)."""


def save_char_tokenizer(
    path: str | Path, alphabet: str, *, chat_template: str | None = None
) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over single characters (ids 0-2: pad, eos, bos), with ``chat_template`` if given,
    saved to ``path``."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{char: index + 3 for index, char in enumerate(alphabet)}}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>")
    core = tokenizers.Tokenizer(model)
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    core.decoder = tokenizers.decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer


QWEN3_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN3_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def qwen3_like_tokenizer(
    merges: tuple[tuple[str, str], ...] = (("1", "2"), ("a", "r")),
) -> transformers.PreTrainedTokenizerFast:
    """A small BPE tokenizer with Qwen3's special and added tokens (``<|im_start|>``, ``<|im_end|>``,
    ``<tool_call>``, ...), over printable ASCII and newlines, with ``merges`` (by default ``"1" "2"`` -> ``"12"``,
    so decoding two generated tokens and encoding the text again gives one: retokenization drift). Built offline:
    no model hub."""
    alphabet = [chr(code) for code in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, **{char: index + 1 for index, char in enumerate(alphabet)}}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    core = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=list(merges), unk_token="<unk>"))
    core.decoder = tokenizers.decoders.Fuse()
    core.add_special_tokens(list(QWEN3_SPECIAL_TOKENS))
    core.add_tokens(list(QWEN3_ADDED_TOKENS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
