"""Miles plugin: the Megatron training backend and its HfWeightIterator."""
