"""Submit-poll RPC over HTTP between the driver and its workers.

* :mod:`~miles_core.workers.rpc.wire`: what travels, as the pydantic models both ends use (submit, poll, call
  record, error body), with the routes, status codes and the token variable;
* :mod:`~miles_core.workers.rpc.server`: a worker's server (``RpcServer``, ``@rpc_method``), with the call store
  (:mod:`~miles_core.workers.rpc.call_store`) that makes a resubmitted call id run once;
* :mod:`~miles_core.workers.rpc.client`: ``RpcClient``, long polling with safe retries until a deadline;
* :mod:`~miles_core.workers.rpc.arguments`: the strict check of arguments against a method's type hints, shared by
  the server and ``WorkerHandle``, and the rebuilding of results from the return hint.

Arguments and results are encoded alike (JSON; dataclasses and pydantic models as objects) and rebuilt from the
method's type hints on the other side.
"""
