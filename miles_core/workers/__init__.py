"""The worker runtime: every long-lived process of a run is a worker, started from a spec (``specs``) by a provider
(``local_provider``, ``ray_provider``) and driven over the worker RPC (``rpc/``). Its public names are re-exported
from ``miles_core``."""
