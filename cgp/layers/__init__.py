"""Layers by Caffe type name. Importing this package registers every layer family."""
from cgp.layers.base import (REGISTRY, Chunk, Factors, Layer, aligned_zeros, alloc_scratch,
                             check_axis, register, supported_types)

# Each family module registers its layers on import.
from cgp.layers import (  # noqa: E402,F401
    activation, conv, data, elementwise, inner_product, loss, losses, lrn, pool, reduction,
    scale, shape,
)
