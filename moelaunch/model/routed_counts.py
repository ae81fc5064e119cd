"""Routed (token, expert) pairs per MoE layer and expert, counted on the device while the model runs.

The MoE layers add into `current` [layers, E] during a step (an index_add, inside a compiled or captured
step too: the tensor's address never changes); `end_step` then files it into a ring of the last `window`
steps and a running total, all device ops that read nothing back. Summing happens only when read.
"""

from __future__ import annotations

import torch


class RoutedCounts:
    def __init__(self, layer_ids: list[int], n_experts: int, window: int, device: torch.device) -> None:
        self.layer_ids = layer_ids
        self.row_of = {layer: i for i, layer in enumerate(layer_ids)}
        self.window = window
        self.current = torch.zeros(len(layer_ids), n_experts, dtype=torch.long, device=device)
        # int32 per step keeps the ring at half the bytes (a step routes far fewer than 2**31 pairs).
        self.ring = torch.zeros(window, len(layer_ids), n_experts, dtype=torch.int32, device=device)
        self.total = torch.zeros_like(self.current)
        self.steps = 0

    def add(self, layer_id: int, ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Count the expert ids [rows, k] of one layer's routed rows; valid [rows] bool leaves out padding."""
        flat = ids.flatten()
        if valid is None:
            ones = torch.ones_like(flat)
        else:
            ones = valid[:, None].expand(ids.shape).flatten().to(flat.dtype)
        self.current[self.row_of[layer_id]].index_add_(0, flat, ones)

    def end_step(self) -> None:
        self.ring[self.steps % self.window].copy_(self.current)
        self.total.add_(self.current)
        self.current.zero_()
        self.steps += 1

    def window_and_total(self) -> torch.Tensor:
        """[2, layers, E] int64: the last `window` steps' counts, and every step's since the start."""
        return torch.stack([self.ring.sum(0, dtype=torch.long), self.total])
