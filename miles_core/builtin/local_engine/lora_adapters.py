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
from miles_core.training.lora import ADAPTER_WEIGHTS_FILE, adapter_digest, adapter_tensors, load_adapter_weights

MAX_ADAPTERS = 64
"""The most adapters one engine holds at once (SGLang's ``--max-loaded-loras`` plays this part)."""
MAX_NAME_CHARS = 256
SPARE_SLOTS = 2
"""Slots of unloaded adapters kept for reuse (a run's steady state needs one: the adapter before the current)."""


class AdapterError(MilesError):
    """An adapter request the engine refuses (unknown name, a name loaded twice, a directory that is no adapter)."""


class LoraAdapters:
    """The adapters loaded into ``model`` (a transformers model, changed in place by peft on the first load), by
    name, and the one its forwards run now (:meth:`activate`). Not thread-safe: the engine calls it with its weights
    held.

    Each adapter lives in a peft *slot* (an adapter of the peft model, named ``slot-N``). An unloaded adapter's slot
    is kept, up to :data:`SPARE_SLOTS` of them, and the next adapter of the same configuration is copied into it in
    place: a run publishes a new adapter each step and unloads the one before, so after the first two steps a load
    reads one file and copies its tensors, instead of peft injecting new layers into every targeted module."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._peft: peft.PeftModel | None = None
        self.paths: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self.slots: dict[str, str] = {}  # adapter name -> its peft slot
        self._spare: list[str] = []  # slots of unloaded adapters, kept for the next load of their configuration
        self._slots_made = 0
        self.active: str | None = None

    def load(self, name: str, path: str) -> str:
        """Load the peft adapter directory ``path`` as ``name``; returns the digest of the adapter as the model now
        holds it (:func:`~miles_core.training.lora.adapter_digest`, what the trainer compares with its own)."""
        check_adapter_name(name)
        if name in self.paths:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first (/unload_lora_adapter)")
        if len(self.paths) >= MAX_ADAPTERS:
            raise AdapterError(f"{MAX_ADAPTERS} adapters are loaded already: unload one first")
        files = [Path(path) / "adapter_config.json", Path(path) / ADAPTER_WEIGHTS_FILE]
        if not all(file.is_file() for file in files):  # safetensors alone: a pickled adapter_model.bin is never read
            raise AdapterError(
                f"lora_path {path[:200]!r} holds no peft adapter in safetensors (adapter_config.json and "
                f"{ADAPTER_WEIGHTS_FILE})"
            )
        try:
            slot = self._load_into_slot(path)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:  # a directory peft cannot load
            raise AdapterError(f"cannot load the adapter {path[:200]!r}: {type(exc).__name__}: {exc}") from None
        self._peft.eval()
        self.paths[name], self.slots[name] = path, slot
        self.digests[name] = adapter_digest(adapter_tensors(self._peft, slot))
        self.activate(self.active)  # peft made the new adapter the active one
        return self.digests[name]

    def _load_into_slot(self, path: str) -> str:
        """The slot now holding the adapter at ``path``: a spare one of the same configuration, its tensors
        overwritten, else a new one peft injects."""
        config = peft.PeftConfig.from_pretrained(path)
        for slot in self._spare:
            if _same_layers(self._peft.peft_config[slot], config):
                load_adapter_weights(self._peft, path, adapter_name=slot)
                self._spare.remove(slot)
                return slot
        slot = f"slot-{self._slots_made}"
        self._slots_made += 1
        try:
            with warnings.catch_warnings():  # peft warns of other adapters' keys absent from this file: expected
                warnings.simplefilter("ignore", UserWarning)
                if self._peft is None:
                    self._peft = peft.PeftModel.from_pretrained(self.model, path, adapter_name=slot)
                else:
                    self._peft.load_adapter(path, adapter_name=slot)
        except Exception:
            self._delete_slot(slot)
            raise
        return slot

    def unload(self, name: str) -> None:
        """Remove the adapter ``name`` from the model (its slot kept as a spare while there are few)."""
        if name not in self.paths:
            raise AdapterError(f"no adapter named {name[:MAX_NAME_CHARS]!r} is loaded (loaded: {self.describe()})")
        slot = self.slots.pop(name)
        del self.paths[name], self.digests[name]
        if self.active == name:
            self.activate(None)
        self._spare.append(slot)
        while len(self._spare) > SPARE_SLOTS:
            self._delete_slot(self._spare.pop(0))

    def _delete_slot(self, slot: str) -> None:
        if self._peft is not None and slot in self._peft.peft_config:
            self._peft.delete_adapter(slot)

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
            self._peft.set_adapter(self.slots[name])
            self._peft.eval()  # set_adapter marks the adapter trainable: no dropout in serving
        self.active = name

    def describe(self) -> str:
        return ", ".join(sorted(self.paths)) or "none"


def _same_layers(held: peft.PeftConfig, loaded: peft.PeftConfig) -> bool:
    """Whether an adapter of config ``loaded`` fits the layers of a slot made for ``held``: the same method, rank,
    scale, targets and the other settings that shape or wrap its layers."""

    def shape(config: peft.PeftConfig) -> dict:
        fields = config.to_dict()
        for incidental in ("inference_mode", "base_model_name_or_path", "revision", "runtime_config"):
            fields.pop(incidental, None)
        return fields

    return shape(held) == shape(loaded)


def check_adapter_name(name: object) -> str:
    """A non-empty adapter name of at most :data:`MAX_NAME_CHARS` printable characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise AdapterError(f"an adapter name is 1 to {MAX_NAME_CHARS} printable characters, got {str(name)[:80]!r}")
    return name
