"""Miles core: hookspecs, plugin manager, config and CLI of the Miles RL post-training toolkit."""

from miles_core.errors import ConfigError, MilesError, PluginHookError, PluginLoadError, RegistryError
from miles_core.hookspecs import hookimpl, hookspec
from miles_core.registry import Implementation, model_implementation

__version__ = "0.2.0"

__all__ = [
    "ConfigError",
    "Implementation",
    "MilesError",
    "PluginHookError",
    "PluginLoadError",
    "RegistryError",
    "__version__",
    "hookimpl",
    "hookspec",
    "model_implementation",
]
