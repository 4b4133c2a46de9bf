"""Evaluation: pure metrics over embeddings (metrics.py, pairs.py), evaluators that embed data (retrieval.py,
zeroshot.py, suite.py) and the eval manifest (manifest.py)."""
