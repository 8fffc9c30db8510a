"""The implementations of cgp's commands beyond train: test, time, equivalence, plot, export."""
