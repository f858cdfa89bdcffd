"""Built-in plugins: the core implements itself through the same hooks that third parties use."""
