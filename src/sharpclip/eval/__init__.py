"""Evaluation: pure metrics over embeddings (metrics.py, pairs.py), embedding (embed.py; evaluator.py builds the one
model embedder that training, the demo and `sharpclip eval` share), the protocols (retrieval.py, zeroshot.py,
pair_data.py, pair_hub.py, scoring.py), the benchmark registry (benchmarks.py), the suite and `sharpclip eval`
(suite.py), its files (report.py) and the eval manifest (manifest.py); forgetting guards (guards.py)."""
