"""Built-in plugins: the core implements itself through the same hooks that third parties use (as pytest keeps its
own plugins in ``_pytest``). The kernel imports none of them: the plugin manager loads ``core_plugin`` (config
sections, cross-section checks, registries naming the implementations below by target), ``dashboard`` and
``metrics`` by name, and each implementation is imported when a run chooses it.

* ``core_plugin.py``: the core sections, flags and checks, and the registries of the built-in implementations;
* ``local_engine/``: the ``local`` engine backend, a CPU-friendly server speaking SGLang's HTTP API;
* ``torch_trainer.py``: the ``torch`` training backend;
* ``ray_provider.py``: the ``ray`` worker provider;
* ``dashboard/``: the run dashboard (its hooks, store, server and ``miles dashboard``);
* ``metrics/``: the Prometheus and TensorBoard exporters.
"""
