"""Caffe compatibility: pycaffe's API, NetSpec, caffe.io and the upgrades of old prototxt."""
