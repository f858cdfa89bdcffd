"""LoRA adapters served by the local engine, as SGLang serves them: loaded by name from a peft directory
(``/load_lora_adapter``), unloaded by name (``/unload_lora_adapter``), and chosen per request (``lora_path`` on
``/generate`` names a loaded adapter). The adapters are injected into the engine's model with ``peft``; a forward runs
one adapter (or none: the base), so the engine batches the requests of one adapter together."""

from __future__ import annotations

import warnings
from pathlib import Path

import peft
import torch

from miles_core.errors import MilesError
from miles_core.training.lora import adapter_digest

MAX_ADAPTERS = 64
"""The most adapters one engine holds at once (SGLang's ``--max-loaded-loras`` plays this part)."""
MAX_NAME_CHARS = 256


class AdapterError(MilesError):
    """An adapter request the engine refuses (unknown name, a name loaded twice, a directory that is no adapter)."""


class LoraAdapters:
    """The adapters loaded into ``model`` (a transformers model, changed in place by peft on the first load), by
    name, and the one its forwards run now (:meth:`activate`). Not thread-safe: the engine calls it with its weights
    held."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._peft: peft.PeftModel | None = None
        self.paths: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self.active: str | None = None

    def load(self, name: str, path: str) -> str:
        """Load the peft adapter directory ``path`` as ``name``; returns the digest of the adapter as the model now
        holds it (:func:`~miles_core.training.lora.adapter_digest`, what the trainer compares with its own)."""
        check_adapter_name(name)
        if name in self.paths:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first (/unload_lora_adapter)")
        if len(self.paths) >= MAX_ADAPTERS:
            raise AdapterError(f"{MAX_ADAPTERS} adapters are loaded already: unload one first")
        files = [Path(path) / "adapter_config.json", Path(path) / "adapter_model.safetensors"]
        if not all(file.is_file() for file in files):  # safetensors alone: a pickled adapter_model.bin is never read
            raise AdapterError(
                f"lora_path {path[:200]!r} holds no peft adapter in safetensors (adapter_config.json and "
                "adapter_model.safetensors)"
            )
        try:
            with warnings.catch_warnings():  # peft warns of other adapters' keys absent from this file: expected
                warnings.simplefilter("ignore", UserWarning)
                if self._peft is None:
                    self._peft = peft.PeftModel.from_pretrained(self.model, path, adapter_name=name)
                else:
                    self._peft.load_adapter(path, adapter_name=name)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:  # a directory peft cannot load
            self._forget(name)
            raise AdapterError(f"cannot load the adapter {path[:200]!r}: {type(exc).__name__}: {exc}") from None
        self._peft.eval()
        self.paths[name] = path
        self.digests[name] = adapter_digest(peft.get_peft_model_state_dict(self._peft, adapter_name=name))
        self.activate(self.active)  # peft made the new adapter the active one
        return self.digests[name]

    def unload(self, name: str) -> None:
        """Remove the adapter ``name`` from the model."""
        if name not in self.paths:
            raise AdapterError(f"no adapter named {name[:MAX_NAME_CHARS]!r} is loaded (loaded: {self.describe()})")
        self._forget(name)
        del self.paths[name], self.digests[name]
        if self.active == name:
            self.activate(None)

    def _forget(self, name: str) -> None:
        if self._peft is not None and name in self._peft.peft_config:
            self._peft.delete_adapter(name)

    def activate(self, name: str | None) -> None:
        """Make the model's forwards run the adapter ``name``, or the base alone (``None``)."""
        if self._peft is None:
            if name is not None:
                raise AdapterError(f"no adapter named {name!r} is loaded")
            return
        if name is None:
            self._peft.base_model.disable_adapter_layers()
        else:
            self._peft.base_model.enable_adapter_layers()
            self._peft.set_adapter(name)
            self._peft.eval()  # set_adapter marks the adapter trainable: no dropout in serving
        self.active = name

    def describe(self) -> str:
        return ", ".join(sorted(self.paths)) or "none"


def check_adapter_name(name: object) -> str:
    """A non-empty adapter name of at most :data:`MAX_NAME_CHARS` printable characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise AdapterError(f"an adapter name is 1 to {MAX_NAME_CHARS} printable characters, got {str(name)[:80]!r}")
    return name
