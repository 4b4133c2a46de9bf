"""Training: the loop (trainer.py), one step (step.py), exact accumulation (accumulate.py), global-batch gathering
(distributed.py), checkpoints and resume (checkpoint.py, resume.py, run_dir.py), gradient diagnostics, logging, and the
`sharpclip train` / `sharpclip distill` entry points (run.py, distill.py)."""
