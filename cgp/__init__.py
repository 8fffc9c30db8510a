"""cgp: coarse-grain batch-parallel CPU trainer for Caffe networks."""
