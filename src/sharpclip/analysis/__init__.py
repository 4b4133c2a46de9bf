"""The papers' analyses as figures: caption geometry (geometry.py), training dynamics and convergence (dynamics.py),
and one plotting function per figure (plots.py), each writing a PNG and its numbers as JSON."""
