"""Caffe's protobuf schema (caffe.proto) and its generated Python module: `from cgp.proto import caffe_pb2`.

caffe_pb2 is not imported here, so that `python -m cgp.proto.generate` still runs when it is missing or stale.
"""
