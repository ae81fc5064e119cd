"""Offline checkpoint tools, each writing a Hugging Face checkpoint that loads unchanged: `launch convert`
(FP8 to bf16, weight quantization), `launch prune` (experts, attention heads, weights by magnitude) and
`launch distill` (a smaller student)."""
