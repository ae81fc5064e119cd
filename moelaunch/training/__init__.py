"""Training, outside the runtime path: the bundled small model's trainer (small_model/)."""
