"""``DigitTokenizer``: the embedded default's character-level tokenizer (digits, ``:`` and special tokens)."""

from __future__ import annotations

from pathlib import Path

from miles_core.errors import MilesError

SPECIALS = ("<pad>", "<eos>", "<bos>")
CHARACTERS = ":0123456789"


class DigitTokenizer:
    """Maps each character of ``CHARACTERS`` to one token; ids 0-2 are ``<pad>``, ``<eos>``, ``<bos>``."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2
    vocab_size = len(SPECIALS) + len(CHARACTERS)

    def __init__(self) -> None:
        self._ids = {char: index + len(SPECIALS) for index, char in enumerate(CHARACTERS)}

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        unknown = sorted(set(text) - set(self._ids))
        if unknown:
            raise MilesError(f"the default tokenizer knows only {CHARACTERS!r}; {text!r} has {unknown}")
        return ([self.bos_token_id] if add_bos else []) + [self._ids[char] for char in text]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Characters of the ids; decoding stops at ``<eos>`` and skips the other special tokens (always: the
        keyword is accepted for the signature of HF tokenizers)."""
        text = []
        for token in ids:
            if token == self.eos_token_id:
                break
            if token >= len(SPECIALS):
                text.append(CHARACTERS[token - len(SPECIALS)])
        return "".join(text)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the same tokenizer as HF tokenizer files (``tokenizer.json`` and its config), so that a checkpoint
        of the default run loads with ``AutoTokenizer`` (``--model CHECKPOINT``) and encodes to the same ids."""
        import tokenizers  # deferred: only runs that write the default model need them
        import transformers

        vocab = {**{token: index for index, token in enumerate(SPECIALS)}, **self._ids}
        # "<unk>" is not in the vocabulary: an unknown character is an error, as in encode(), not a silent pad
        core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")  # one token per character
        core.decoder = tokenizers.decoders.Fuse()
        core.post_processor = tokenizers.processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", self.bos_token_id)]
        )
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
        )
        hf.save_pretrained(directory)
        return Path(directory)
