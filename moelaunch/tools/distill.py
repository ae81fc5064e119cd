"""Distillation: train a smaller student (see distill_student.py) to reproduce the teacher's output
distribution (KL divergence on temperature-softened logits, for the main head and the MTP layer) and,
with `features`, the teacher's hidden states after each kept layer (MSE relative to their size).

The state (student weights, optimizer, step) is saved in OUT every `save_every` steps and at the end;
`resume` continues from it and reaches the same weights as an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moelaunch.model import CheckpointReader, Transformer, load_model
from moelaunch.model.checkpoint import check_new_checkpoint_dir, check_writable_dir
from moelaunch.text.files import check_readable
from moelaunch.tools.calibration import calibration_sequences
from moelaunch.tools.checkpoint_writer import (
    read_config,
    read_tensors,
    write_checkpoint,
)
from moelaunch.tools.distill_data import DistillBatch, DistillData
from moelaunch.tools.distill_student import kept_layers, student_config, student_tensors
from moelaunch.tools.expert_pruning import count_expert_usage
from moelaunch.training.checkpoint import checkpoint_tensors
from moelaunch.training.loop import LoopConfig, TrainingLoop

STATE_FILE = "distill_state.pt"
DEFAULT_TRAIN = LoopConfig(steps=300, batch=64, lr=1e-3, warmup=30, save_every=100)


@dataclass
class DistillConfig:
    teacher: Path
    out: Path
    layers: int
    experts: int
    features: bool = False
    prompts: Path | None = None
    resume: bool = False
    temperature: float = 2.0
    feature_weight: float = 1.0
    mtp_weight: float = 0.3
    n_group: int | None = None
    topk_group: int | None = None
    train: LoopConfig = field(default_factory=lambda: replace(DEFAULT_TRAIN))

    def identity(self) -> dict[str, object]:
        """What a resumed run must share with the run that saved the state."""
        return {
            "layers": self.layers,
            "experts": self.experts,
            "features": self.features,
            "seed": self.train.seed,
        }


def check_config(cfg: DistillConfig) -> dict[str, Any]:
    """The student's config.json, after every check that needs no model (so errors come first)."""
    if cfg.train.steps < 1 or cfg.train.batch < 1 or cfg.temperature <= 0:
        raise ValueError("steps and batch must be positive and the temperature above 0")
    state = cfg.out / STATE_FILE
    if cfg.resume and not state.exists():
        raise ValueError(f"--resume: {state} not found; start without --resume in a new directory")
    if cfg.resume:
        check_writable_dir(cfg.out, "OUT")
    else:
        check_new_checkpoint_dir(cfg.teacher, cfg.out)
    if cfg.prompts is not None:  # read once the teacher has loaded: its errors come now
        check_readable(cfg.prompts, "--prompts file")
    return student_config(read_config(cfg.teacher), cfg.layers, cfg.experts, cfg.n_group, cfg.topk_group)


def init_student(cfg: DistillConfig, teacher: Transformer, config: dict[str, Any]) -> None:
    """Write the student's starting checkpoint into OUT (teacher layers and most used experts)."""
    usage = count_expert_usage(teacher, calibration_sequences(cfg.teacher, cfg.prompts, seed=cfg.train.seed))
    tensors = student_tensors(read_tensors(cfg.teacher), teacher.args, cfg.layers, usage, cfg.experts)
    write_checkpoint(cfg.teacher, cfg.out, tensors, config)


def kl_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per position on softened logits [N, vocab], times T^2 so the gradient
    scale does not depend on T (Hinton et al.)."""
    s = F.log_softmax(student / temperature, dim=-1)
    t = F.log_softmax(teacher / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


class LayerOutputs:
    """Forward hooks keeping each listed decoder layer's output [N, dim], for the model's lifetime."""

    def __init__(self, model: Transformer, layers: list[int]) -> None:
        self.outputs: list[torch.Tensor] = []
        for i in layers:
            model.model.layers[str(i)].register_forward_hook(self._keep)

    def _keep(self, _module: torch.nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        self.outputs.append(output)

    def take(self) -> list[torch.Tensor]:
        outputs, self.outputs = self.outputs, []
        return outputs


@dataclass
class StepLosses:
    total: torch.Tensor
    kl: torch.Tensor
    mtp: torch.Tensor
    features: torch.Tensor

    def logged(self) -> dict[str, torch.Tensor]:
        return {"loss": self.total, "kl": self.kl, "mtp": self.mtp, "features": self.features}


class Distiller:
    """The losses of one step: the student against the teacher on the same batch."""

    def __init__(self, cfg: DistillConfig, teacher: Transformer, student: Transformer) -> None:
        self.cfg, self.teacher, self.student = cfg, teacher, student
        layers = kept_layers(teacher.args.num_hidden_layers, cfg.layers)
        self.teacher_layers = LayerOutputs(teacher, layers if cfg.features else [])
        self.student_layers = LayerOutputs(student, list(range(cfg.layers)) if cfg.features else [])

    def losses(self, batch: DistillBatch) -> StepLosses:
        with torch.no_grad():
            t_hidden = self.teacher.hidden_states(batch.ids)
            t_logits = self.teacher.head(t_hidden)
            t_feats = self.teacher_layers.take()
        s_hidden = self.student.hidden_states(batch.ids)
        s_logits = self.student.head(s_hidden)
        s_feats = self.student_layers.take()
        # Position i predicts token i+1; it is distilled where token i+1 is scored.
        target = batch.scored[:, 1:]
        kl = kl_loss(s_logits[:, :-1][target], t_logits[:, :-1][target], self.cfg.temperature)
        total = kl
        mtp = torch.zeros(())
        if len(self.student.mtp) and len(self.teacher.mtp):
            # The MTP at i predicts token i+2 from token i+1, scored where both are (as in training).
            mtp_target = batch.scored[:, 2:] & batch.scored[:, 1:-1]
            with torch.no_grad():
                t_mtp = self.teacher.mtp_logits(t_hidden[:, :-1], batch.ids[:, 1:])[:, :-1]
            s_mtp = self.student.mtp_logits(s_hidden[:, :-1], batch.ids[:, 1:])[:, :-1]
            mtp = kl_loss(s_mtp[mtp_target], t_mtp[mtp_target], self.cfg.temperature)
            total = total + self.cfg.mtp_weight * mtp
        features = torch.zeros(())
        if self.cfg.features:
            valid = batch.valid.flatten()
            # Relative MSE: each layer's error as a share of its teacher activations' mean square.
            features = torch.stack(
                [
                    F.mse_loss(s[valid], t[valid]) / t[valid].pow(2).mean()
                    for s, t in zip(s_feats, t_feats, strict=True)
                ]
            ).mean()
            total = total + self.cfg.feature_weight * features
        return StepLosses(total, kl, mtp, features)


def _save_state(cfg: DistillConfig, loop: TrainingLoop) -> None:
    tmp = cfg.out / (STATE_FILE + ".tmp")
    torch.save({"identity": cfg.identity(), **loop.state_dict()}, tmp)
    tmp.replace(cfg.out / STATE_FILE)  # a crash while saving leaves the previous state whole


def _stored_dtype(path: Path) -> torch.dtype:
    """The dtype the teacher stores its weights in (the student is written the same way)."""
    return CheckpointReader(path).read("model.embed_tokens.weight").dtype


def _load_state(cfg: DistillConfig) -> dict[str, Any]:
    state = torch.load(cfg.out / STATE_FILE, weights_only=True)
    if state["identity"] != cfg.identity():
        raise ValueError(
            f"{cfg.out / STATE_FILE} was saved by a run with {state['identity']}: resume with those"
        )
    return state


def distill(cfg: DistillConfig) -> list[float]:
    """Run the distillation; returns the total loss of each step this run made."""
    config = check_config(cfg)
    state = _load_state(cfg) if cfg.resume else None
    teacher = load_model(cfg.teacher)
    if state is None:
        init_student(cfg, teacher, config)
    student = load_model(cfg.out).train().requires_grad_(True)
    loop = TrainingLoop(student, cfg.train)
    if state is not None:
        loop.load_state_dict(state)
    data = DistillData(cfg.teacher, cfg.prompts, cfg.train.batch, cfg.train.seed)
    batches = map(data.batch_at, range(loop.step, cfg.train.steps))
    distiller = Distiller(cfg, teacher, student)
    history = loop.run(batches, distiller.losses, lambda: _save_state(cfg, loop))
    _save_state(cfg, loop)
    tensors = checkpoint_tensors(student.eval(), _stored_dtype(cfg.teacher))
    write_checkpoint(cfg.teacher, cfg.out, tensors, config)
    return history
