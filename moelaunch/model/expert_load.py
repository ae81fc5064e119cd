"""Tokens routed to each expert, counted by forward hooks on the MoE gates (no change to the model)."""

from __future__ import annotations

import torch
from torch import nn

from moelaunch.model.gate import Gate
from moelaunch.model.moe import MoE


class ExpertLoad:
    """Context manager: while active, `counts[layer_name]` accumulates tokens per expert.

    `valid` ([B, T] bool, optional) excludes padding: a gate that sees B*T' tokens counts those whose
    position is below T' in `valid` (an MTP layer sees one position fewer than the main layers).
    """

    def __init__(self, model: nn.Module) -> None:
        self.gates = {name: m for name, m in model.named_modules() if isinstance(m, Gate)}
        self.counts = {name: torch.zeros(g.n_experts, dtype=torch.long) for name, g in self.gates.items()}
        # Gate name -> decoder layer index (MTP layers: their checkpoint index), for the expert-load file.
        self.layer_of = {
            f"{name}.mlp.gate": m.layer_id
            for name, m in model.named_modules()
            if isinstance(getattr(m, "mlp", None), MoE)
        }
        self.valid: torch.Tensor | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> ExpertLoad:
        for name, gate in self.gates.items():
            self._handles.append(gate.register_forward_hook(self._counter(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _counter(self, name: str):
        def hook(_gate: nn.Module, _inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            ids = output[1]
            if self.valid is not None:
                width = ids.shape[0] // self.valid.shape[0]
                ids = ids[self.valid[:, :width].reshape(-1)]
            self.counts[name] += torch.bincount(ids.flatten().cpu(), minlength=len(self.counts[name]))

        return hook

    def reset(self) -> None:
        for c in self.counts.values():
            c.zero_()

    def by_layer(self) -> dict[int, torch.Tensor]:
        """counts keyed by decoder layer index (model/expert_load_file.py's keys)."""
        return {self.layer_of[name]: c for name, c in self.counts.items()}

    def imbalance(self) -> dict[str, float]:
        """max/mean tokens per expert for each gate (1.0 is perfect balance)."""
        return {name: (c.max() / c.float().mean().clamp(min=1e-9)).item() for name, c in self.counts.items()}
