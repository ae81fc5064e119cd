"""The training loop of the bundled model's trainer and of distillation: AdamW under a warmup-then-cosine
learning rate, clipped gradients, DeepSeek-V3's auxiliary-loss-free expert balancing, a log line every
`log_every` steps and a save every `save_every`. The caller supplies the batches and the losses."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from moelaunch.model.expert_load import ExpertLoad
from moelaunch.model.transformer import Transformer


@dataclass(kw_only=True)
class LoopConfig:
    """A run's settings; `batch` and `seed` are for the caller's data, which the loop only consumes."""

    steps: int
    batch: int  # rows per step
    lr: float
    warmup: int
    seed: int = 0  # draws the data
    bias_step: float = 2e-3  # gamma of the balancing update
    log_every: int = 50
    save_every: int = 500


class Rows(Protocol):
    valid: torch.Tensor  # [B, T] bool: real tokens, the ones whose routing counts towards the balance


class Losses(Protocol):
    total: torch.Tensor  # what the step minimises

    def logged(self) -> dict[str, torch.Tensor]:
        """The values the log line shows, by name."""
        ...


B = TypeVar("B", bound=Rows)


def lr_at(step: int, cfg: LoopConfig) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def balance_experts(load: ExpertLoad, step: float) -> None:
    """Aux-loss-free balancing: raise the routing bias of under-loaded experts, lower the over-loaded."""
    for name, gate in load.gates.items():
        counts = load.counts[name].float()
        gate.e_score_correction_bias += step * torch.sign(counts.mean() - counts)


class TrainingLoop:
    """The model's optimizer and the number of steps taken: what a stopped run resumes from."""

    def __init__(self, model: Transformer, cfg: LoopConfig) -> None:
        self.model, self.cfg = model, cfg
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = state["step"]

    def run(
        self,
        batches: Iterator[B],
        losses: Callable[[B], Losses],
        save: Callable[[], None],
        progress: Callable[[], str] | None = None,
    ) -> list[float]:
        """Steps from `self.step` to `cfg.steps`, one batch each; returns each step's total loss.

        `save` runs every `save_every` steps but not after the last: the caller writes its result.
        `progress` adds to each log line what the caller measured since the previous one.
        """
        cfg = self.cfg
        load = ExpertLoad(self.model)
        history = []
        began = time.time()
        with load:
            while self.step < cfg.steps:
                batch = next(batches)
                load.reset()
                load.valid = batch.valid
                step_losses = losses(batch)
                self._update(step_losses.total)
                balance_experts(load, cfg.bias_step)
                history.append(step_losses.total.item())
                if self.step % cfg.log_every == 0 or self.step == cfg.steps - 1:
                    self._log(step_losses, load, time.time() - began, progress() if progress else "")
                self.step += 1
                if self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    save()
        return history

    def _update(self, loss: torch.Tensor) -> None:
        """One optimizer step at this step's learning rate, the gradient clipped to norm 1."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def _log(self, step_losses: Losses, load: ExpertLoad, seconds: float, extra: str) -> None:
        shown = " ".join(f"{name} {value.item():.4f}" for name, value in step_losses.logged().items())
        worst = max(load.imbalance().values())
        lr = lr_at(self.step, self.cfg)
        line = f"step {self.step} {shown} max/mean load {worst:.2f} lr {lr:.2e} {seconds:.0f}s{extra}"
        print(line, flush=True)
