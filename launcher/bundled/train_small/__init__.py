"""Training of the small DeepSeek-V3 shipped in checkpoints/small.

`python -m moelaunch.launcher.bundled.train_small --out checkpoints/small`
"""
