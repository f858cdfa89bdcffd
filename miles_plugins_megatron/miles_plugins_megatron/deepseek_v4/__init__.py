"""The ``miles`` implementation of DeepSeek-V4 (``--dsv4-impl miles``), built on megatron-core's parallel layers."""

from miles_plugins_megatron.deepseek_v4.causal_lm import MilesDeepseekV4CausalLM
from miles_plugins_megatron.deepseek_v4.model import DeepseekV4Model, build_deepseek_v4
from miles_plugins_megatron.deepseek_v4.naming import DeepseekV4HfWeightIterator, load_hf_state

__all__ = [
    "DeepseekV4HfWeightIterator",
    "DeepseekV4Model",
    "MilesDeepseekV4CausalLM",
    "build_deepseek_v4",
    "load_hf_state",
]
