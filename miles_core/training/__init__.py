"""Training: losses, batches, the weight-export API and the built-in torch trainer."""
