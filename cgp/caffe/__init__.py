"""Caffe compatibility: pycaffe's API (pycaffe, pylayer: Python layers' caffe.Layer), NetSpec,
caffe.io, caffe.draw, caffe.coord_map, `import caffe` as cgp (run, alias) and the upgrades of
old prototxt."""
