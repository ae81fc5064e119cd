"""Training of the small DeepSeek-V3 shipped in checkpoints/small (`python -m launcher.train_small`)."""
