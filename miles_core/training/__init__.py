"""Training: the backend contract, losses, batches, optimizers and the weight-export API (the built-in torch trainer
is :mod:`miles_core.builtin.torch_trainer`)."""
