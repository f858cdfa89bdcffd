"""Save a real HF tokenizer (character level) next to a tiny checkpoint, without any hub access."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import transformers


def save_char_tokenizer(path: str | Path, alphabet: str) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over single characters (ids 0-2: pad, eos, bos), saved to ``path``."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{char: index + 3 for index, char in enumerate(alphabet)}}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>")
    core = tokenizers.Tokenizer(model)
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    core.decoder = tokenizers.decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                                     bos_token="<s>")  # fmt: skip
    tokenizer.save_pretrained(path)
    return tokenizer
