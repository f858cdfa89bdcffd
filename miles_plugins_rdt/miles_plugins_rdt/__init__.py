"""Miles plugin: P2P weight transfer over Ray Direct Transport (NIXL)."""
