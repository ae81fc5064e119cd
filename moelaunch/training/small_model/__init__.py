"""Training of the small DeepSeek-V3 shipped in checkpoints/small.

`python -m moelaunch.training.small_model --out checkpoints/small`
"""
