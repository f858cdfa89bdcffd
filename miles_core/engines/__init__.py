"""Inference engines, as the kernel sees them: the engine backend contract, the client of SGLang's HTTP API, the typed
``/generate`` request and answer, routed experts and weight loading. The built-in local engine is in
:mod:`miles_core.builtin.local_engine`."""
