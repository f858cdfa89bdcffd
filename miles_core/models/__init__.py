"""Model implementations: several implementations of one family load the same HF checkpoint names."""
