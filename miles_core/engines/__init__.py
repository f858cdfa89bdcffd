"""Inference engines. The built-in local engine serves SGLang's native HTTP API from a transformers model."""
