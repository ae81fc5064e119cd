"""Training, offline and never on the serving path.

loop.py         the training loop: optimizer, learning-rate schedule, expert balancing, logging, saves
checkpoint.py   a trained model's weights as Hugging Face tensors
small_model/    the bundled model's trainer (`python -m moelaunch.training.small_model`)

Distillation (tools/distill.py) runs the same loop with its own losses and data.
"""
