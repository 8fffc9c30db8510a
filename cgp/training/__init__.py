"""The units that cgp.train's Trainer runs around its loop, each with one concern: the run's
settings (config), the solver's files (solver_files), the memory check (memory), when a
periodic unit is due (triggers), the display and progress bar (progress), the periodic
tests (testing), snapshots and resuming (snapshots), signals (signals) and the message of a
diverged step (divergence). None of them runs a step; the Trainer sequences them."""
