"""Measuring tools beside the trainer: `cgp bench speedup` (speedup.py, with the machine's
description in machine.py and its statistics in stats.py), the PyTorch copy of a net
(torch_ref.py) and generated data sets in the official formats (fake_data.py). The trainer
never imports them."""
