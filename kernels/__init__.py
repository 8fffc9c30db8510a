"""Numba layer kernels: forward/backward pairs over preallocated float32 arrays (installed as cgp.kernels)."""
