"""The bundled small model's task family: its problems (tasks.py), the ways people ask them (phrasing.py),
the training and held-out sets (problem_sets.py) and what the chat says the model can do."""
