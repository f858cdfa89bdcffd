"""The embedded default: a tokenizer, a task, a reward and a tiny model, so ``miles train`` runs with no inputs."""
