"""Train the small DeepSeek-V3 on the task family's conversations: next-token loss on every answer, the
MTP layer's next-next-token loss alongside, and DeepSeek-V3's auxiliary-loss-free expert balancing."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moelaunch.model.config import args_from_hf_config
from moelaunch.model.expert_load import ExpertLoad
from moelaunch.model.gate import Gate
from moelaunch.model.linear import Linear
from moelaunch.model.norm import RMSNorm
from moelaunch.model.transformer import Transformer
from moelaunch.tasks.problem_sets import EVEN_MIX, training_conversations
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.training.loop import LoopConfig, TrainingLoop, balance_experts
from moelaunch.training.small_model.data import Batch, packed_batches
from moelaunch.training.small_model.export import save_checkpoint
from moelaunch.training.small_model.model_config import hf_config
from moelaunch.training.small_model.tokenizer import build_tokenizer, tokenizer_config


@dataclass(kw_only=True)
class TrainConfig(LoopConfig):
    out: Path
    steps: int = 4700
    batch: int = 8  # rows of packed conversations per step
    lr: float = 2e-3
    warmup: int = 100
    width: int = 512  # tokens per row: the longest six-turn conversation fits
    single_turn_steps: int = 3000  # the first steps: single questions in rows a quarter as wide
    mtp_weight: float = 0.3
    routing_steps: int = 400  # then the routing bias alone, balanced on an even mix of kinds
    tiny: bool = False


def init_weights(model: Transformer, std: float = 0.02) -> None:
    """The model is built with empty tensors (a loader fills them); training starts from these.

    Linears start at std fan_in^-0.5: at 0.02 a model this narrow computes near-uniform attention and
    sits for thousands of steps before it learns to look anywhere. Projections into the residual stream
    start small instead (0.02 / sqrt(2 * layers), as GPT-2), so the stream does not grow with depth.
    """
    residual_std = std / math.sqrt(2 * (model.args.num_hidden_layers + len(model.mtp)))
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            is_residual = name.endswith(("o_proj", "down_proj"))
            nn.init.normal_(module.weight, 0.0, residual_std if is_residual else module.in_features**-0.5)
        elif isinstance(module, (nn.Embedding, Gate)):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        if isinstance(module, Gate):
            module.e_score_correction_bias.zero_()


@dataclass
class AnswerLosses:
    main: torch.Tensor  # next-token loss on the answers
    mtp: torch.Tensor  # the MTP layer's next-next-token loss
    total: torch.Tensor  # what the step minimises
    exact: torch.Tensor  # [answers] bool: whether the main model predicts all of each answer

    def logged(self) -> dict[str, torch.Tensor]:
        return {"loss": self.main, "mtp": self.mtp}


def losses(model: Transformer, batch: Batch, mtp_weight: float) -> AnswerLosses:
    hidden = model.hidden_states(batch.ids)
    logits = model.lm_head(hidden).float()
    target = batch.answer[:, 1:]
    main = F.cross_entropy(logits[:, :-1][target], batch.ids[:, 1:][target])
    right = (logits[:, :-1].argmax(-1) == batch.ids[:, 1:]) | ~target
    # The MTP at i sees the main model's hidden at i and token i+1 and predicts token i+2; it is scored
    # where a speculative decoder would use it: i+1 already an answer token.
    mtp_logits = model.mtp_logits(hidden[:, :-1], batch.ids[:, 1:])[:, :-1]
    mtp_target = batch.answer[:, 2:] & batch.answer[:, 1:-1]
    mtp = F.cross_entropy(mtp_logits[mtp_target], batch.ids[:, 2:][mtp_target])
    wrong = torch.zeros(len(batch.kinds)).index_add_(
        0, batch.segment[:, 1:][target], (~right[target]).float()
    )
    return AnswerLosses(main, mtp, main + mtp_weight * mtp, wrong == 0)


class ExactByKind:
    """Teacher-forced exact match per kind since the last log line: a cheap view of progress."""

    def __init__(self) -> None:
        self.solved: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()

    def add(self, kinds: list[str], exact: torch.Tensor) -> None:
        self.seen.update(kinds)
        self.solved.update(k for k, ok in zip(kinds, exact.tolist(), strict=True) if ok)

    def since_last_line(self) -> str:
        line = " | " + " ".join(f"{k} {self.solved[k] / self.seen[k]:.2f}" for k in sorted(self.seen))
        self.solved.clear()
        self.seen.clear()
        return line


@torch.no_grad()
def balance_routing_for_even_mix(model: Transformer, tok: Tokenizer, cfg: TrainConfig) -> None:
    """During training the balancing bias follows the training mix, which favours the hard kinds, in
    packed rows, so it leaves the experts unevenly loaded on a chat's traffic: every kind alike, one
    chat at a time, as in the held-out sets. So training ends with the balancing update alone (weights
    frozen) on that traffic: single questions and conversations in turn, each alone in its row, the
    step shrinking to zero so that the bias settles instead of stepping to and fro."""
    single = training_conversations(cfg.seed + 2, max_turns=1, mix=EVEN_MIX)
    chats = training_conversations(cfg.seed + 3, mix=EVEN_MIX)
    batches = (
        packed_batches(tok, single, cfg.batch * 4, cfg.width // 4, packed=False),
        packed_batches(tok, chats, cfg.batch, cfg.width, packed=False),
    )
    load = ExpertLoad(model)
    with load:
        for step in range(cfg.routing_steps):
            batch = next(batches[step % 2])
            load.reset()
            load.valid = batch.valid
            model.mtp_logits(model.hidden_states(batch.ids)[:, :-1], batch.ids[:, 1:])
            balance_experts(load, cfg.bias_step * (1 - step / cfg.routing_steps))


def curriculum(tok: Tokenizer, cfg: TrainConfig) -> Iterator[Batch]:
    """Single questions in short rows first, then conversations in full rows, the same tokens a step.

    With few tokens before each answer, attention finds the question (and the digits and letters in
    it) in far fewer steps than amid the up to 500 tokens of a packed row of conversations.
    """
    short = training_conversations(cfg.seed, max_turns=1)
    yield from islice(packed_batches(tok, short, cfg.batch * 4, cfg.width // 4), cfg.single_turn_steps)
    yield from packed_batches(tok, training_conversations(cfg.seed + 1), cfg.batch, cfg.width)


def train(cfg: TrainConfig) -> Transformer:
    torch.manual_seed(cfg.seed)
    hf_tok = build_tokenizer()
    tok = Tokenizer(hf_tok, tokenizer_config())
    config = hf_config(tok.vocab_size, tiny=cfg.tiny)
    model = Transformer(args_from_hf_config(config), with_mtp=True)
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M parameters; {cfg.steps} steps of {cfg.batch}x{cfg.width} tokens",
        flush=True,
    )
    exact = ExactByKind()

    def step_losses(batch: Batch) -> AnswerLosses:
        result = losses(model, batch, cfg.mtp_weight)
        exact.add(batch.kinds, result.exact)
        return result

    def save() -> None:
        save_checkpoint(model, config, hf_tok, cfg.out)

    start = time.time()
    TrainingLoop(model, cfg).run(curriculum(tok, cfg), step_losses, save, exact.since_last_line)
    balance_routing_for_even_mix(model, tok, cfg)
    save()
    print(f"wrote {cfg.out} after {time.time() - start:.0f}s", flush=True)
    return model
