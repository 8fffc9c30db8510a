"""Layers by Caffe type name. Importing this package registers every layer family."""
from cgp.layers.base import (REGISTRY, SYNC, Chunk, DeviceOp, Factors, Layer, aligned_zeros,
                             alloc_scratch, check_axis, device_op, onnx_converter, register,
                             scratch_specs, supported_types)

# Each family module registers its layers on import.
from cgp.layers import (  # noqa: E402,F401
    activation, batchnorm, conv, data, elementwise, hdf5_data, image_data, inner_product, loss,
    losses, lrn, memory_data, pool, python, reduction, scale, shape,
)


def __getattr__(name):
    """pycaffe's NetSpec layers: `import cgp as caffe` makes caffe.layers this package, so
    caffe.layers.Convolution(...) (a Caffe type name) specifies a layer (cgp.caffe.netspec)."""
    if name[:1].isupper():
        from cgp.caffe.netspec import layers
        return getattr(layers, name)
    raise AttributeError(f"module 'cgp.layers' has no attribute '{name}'")
