"""`launch eval --model DIR [--n 500]`: score a checkpoint of the task family on the held-out set.

Greedy generation through the project's generate path; reports accuracy per kind, expert load
balance (max/mean tokens per expert, per MoE layer) and MTP draft acceptance. The last line is
`accuracy=<fraction> n=<count>`.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from moelaunch.launcher.bundled.expert_load import ExpertLoad
from moelaunch.launcher.bundled.task_model import DEFAULT_CHECKPOINT, TaskModel
from moelaunch.launcher.bundled.tasks import HELD_OUT_SIZE, held_out_sample, is_correct


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="exact-match accuracy of a task-family checkpoint on held-out problems"
    )
    p.add_argument(
        "--model", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory (default: the shipped one)"
    )
    p.add_argument("--n", type=int, default=500, help=f"held-out problems to score (1..{HELD_OUT_SIZE})")
    p.set_defaults(func=run)


@torch.inference_mode()
def mtp_acceptance(tm: TaskModel, sequences: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(accepted, drafted): positions of the generated answers where the MTP layer's argmax for token
    i+2 (from the main model's hidden at i and token i+1) equals the main model's greedy token i+2.

    Drafts start where token i+1 is the first generated token, as in speculative decoding.
    """
    accepted = drafted = 0
    for prompt, answer in sequences:
        if len(answer) < 2:
            continue
        ids = torch.tensor([prompt + answer])
        hidden = tm.model.hidden_states(ids)
        draft = tm.model.mtp_logits(hidden[:, :-1], ids[:, 1:]).argmax(-1)[0]
        # draft[i] guesses ids[i + 2]; i runs from the last prompt token to the third-last token.
        first = len(prompt) - 1
        guesses, truth = draft[first : ids.shape[1] - 2], ids[0, first + 2 :]
        accepted += int((guesses == truth).sum())
        drafted += len(truth)
    return accepted, drafted


def run(args: argparse.Namespace) -> int:
    problems = held_out_sample(args.n)
    tm = TaskModel.load(args.model)
    sequences = []
    right: Counter[str] = Counter()
    total: Counter[str] = Counter()
    # Main-layer gates are counted during generation; the MTP layer's during the acceptance pass.
    with ExpertLoad(tm.model.model) as main_load:
        for p in problems:
            prompt = tm.prompt_ids(p.prompt)
            answer = tm.generate_ids(prompt)
            sequences.append((prompt, answer))
            total[p.kind] += 1
            right[p.kind] += is_correct(p, tm.tokenizer.decode(answer))
    for kind in total:
        print(f"{kind:8s} {right[kind]}/{total[kind]}")
    print("expert load, max/mean tokens per expert (1.00 is even):")
    for name, ratio in main_load.imbalance().items():
        print(f"  layer {name.split('.')[1]}: {ratio:.2f}")
    if len(tm.model.mtp) == 0:
        print("MTP draft acceptance: n/a (no MTP weights in the checkpoint)")
    else:
        with ExpertLoad(tm.model.mtp) as mtp_load:
            accepted, drafted = mtp_acceptance(tm, sequences)
        for name, ratio in mtp_load.imbalance().items():
            layer = tm.model.args.num_hidden_layers + int(name.split(".")[0])
            print(f"  layer {layer} (MTP): {ratio:.2f}")
        print(f"MTP draft acceptance: {accepted / max(drafted, 1):.4f} ({accepted}/{drafted} drafted tokens)")
    n_right = sum(right.values())
    print(f"accuracy={n_right / len(problems):.4f} n={len(problems)}")
    return 0
