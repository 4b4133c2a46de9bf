"""Dual encoders: the `DualEncoder` protocol, HF CLIP / SigLIP adapters, long context, peft adapters and export."""
