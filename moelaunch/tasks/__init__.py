"""The bundled small model's task family: its problems, how it is asked them, its training and scoring."""
