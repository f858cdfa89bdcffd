"""Miles plugin: SGLang engines and the sglang-router."""
