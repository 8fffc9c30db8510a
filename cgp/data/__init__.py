"""Data sets on disk: LMDB, LevelDB, HDF5, images, and the converters that write them."""
