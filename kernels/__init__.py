"""Numba layer kernels, one file per layer family: forward/backward pairs over preallocated
arrays (installed as cgp.kernels). The machinery they build on is cgp.runtime."""
import cgp.runtime  # noqa: F401  (first: it sets up the compiled-code cache, see there)
