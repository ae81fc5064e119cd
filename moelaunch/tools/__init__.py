"""Model compression: pruning (experts, attention heads, weights by magnitude) and distillation into a
smaller student, each writing a Hugging Face checkpoint that loads unchanged."""
