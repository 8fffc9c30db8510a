"""Dataset readers and lookup (installed as cgp.datasets)."""
