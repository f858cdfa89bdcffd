"""The built-in local engine (``--engine local``): a CPU-friendly server that speaks SGLang's HTTP API.

``backend.py`` registers it (the ``local`` engine backend) and launches it; ``server.py`` serves SGLang's native
routes and ``openai_routes.py`` the OpenAI-compatible ones, sharing ``serving.py``'s limits; ``engine.py`` batches
requests continuously over ``running_batch.py`` (or ``recomputing_batch.py`` for caches that cannot be merged,
chosen in ``batch_generation.py``) and samples with ``sampling.py``.
"""
