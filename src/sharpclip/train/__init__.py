"""Training: global-batch gathering, exact accumulation, and (to come) the loop, checkpoints and diagnostics."""
