"""Data: where a partition's samples come from and in which order it sees them."""
