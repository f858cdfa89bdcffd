"""Exceptions raised by the core. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class MilesError(Exception):
    """Base class of every error Miles raises on purpose; the CLI prints its message and exits non-zero."""


class PluginLoadError(MilesError):
    """A plugin could not be imported or registered."""


class RegistryError(MilesError):
    """A registry name is provided twice, or a requested name is not provided."""


class ConfigError(MilesError):
    """The configuration is malformed or invalid."""


class PluginHookError(MilesError):
    """A plugin's hook implementation raised, or returned something its hook does not allow."""


class EngineError(MilesError):
    """An engine refused a request, answered unsuccessfully, or answered in a shape Miles cannot read."""
