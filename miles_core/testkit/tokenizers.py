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
