"""Configuration: frozen pydantic sections contributed by plugins, built from defaults, YAML and flags."""

from miles_core.config.build import MilesConfig, build_config, config_model, load_config_file
from miles_core.config.flags import ConfigFlag
from miles_core.config.section import Section

__all__ = ["ConfigFlag", "MilesConfig", "Section", "build_config", "config_model", "load_config_file"]
