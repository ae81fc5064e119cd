"""Moving one MoE layer to a new expert placement while the model is loaded: every EP rank computes the
same moves from the old and new maps, the expert tensors a rank gains arrive from an old owner in one
all_to_all over the EP group (every tensor the expert's projections hold: weights, and any quantization
scales and zero points, as raw bytes), and the layer gets its new experts, stacks and dispatcher.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moelaunch.model.moe import MoE
from moelaunch.parallel.expert_parallel import AllToAllDispatch, ExpertPlacement
from moelaunch.parallel.group import Group


def expert_moves(old: ExpertPlacement, new: ExpertPlacement) -> list[tuple[int, int, int]]:
    """(source rank, destination rank, expert) for every copy a rank gains, in (source, destination,
    expert) order; the source is one of the expert's old owners, chosen by the destination so that
    the copies of one expert are sent by different owners."""
    moves = []
    for e, owners in enumerate(new.owners):
        had = old.owners[e]
        for dst in owners:
            if dst not in had:
                moves.append((had[dst % len(had)], dst, e))
    return sorted(moves)


def _as_bytes(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()])


def _from_bytes(row: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name, t in like.items():
        n = t.numel() * t.element_size()
        # A copy first: the slice may start at an offset the target dtype cannot view from.
        out[name] = row[start : start + n].clone().view(t.dtype).view(t.shape)
        start += n
    return out


def _new_expert(template: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """An expert module shaped like `template` holding `tensors` (its state dict's names)."""
    # The template's tensors are views of the layer's stacks: the memo keeps deepcopy from copying them.
    memo = {id(t): None for t in [*template.parameters(), *template.buffers()]}
    expert = copy.deepcopy(template, memo)
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        module = expert.get_submodule(owner)
        setattr(module, attr, nn.Parameter(t, requires_grad=False) if attr == "weight" else t)
    return expert


@torch.no_grad()
def move_layer(moe: MoE, new: ExpertPlacement, ep: Group, tp: Group) -> int:
    """Give `moe` the experts `new` places on this EP rank, its stacks rebuilt and a dispatcher on `new`.
    Every EP rank calls it with the same `new`. Returns the bytes this rank received."""
    old = moe.dispatch.placement
    if new.owners == old.owners:
        return 0
    moves = expert_moves(old, new)
    template = moe.experts[str(moe.local_ids[0])]
    like = template.state_dict()
    width = sum(t.numel() * t.element_size() for t in like.values())
    outgoing = [(dst, e) for src, dst, e in moves if src == ep.index]
    rows = [_as_bytes(moe.experts[str(e)].state_dict()) for _, e in outgoing]
    device = template.down_proj.weight.device
    send = torch.stack(rows) if rows else torch.empty(0, width, dtype=torch.uint8, device=device)
    sends = [sum(dst == r for dst, _ in outgoing) for r in range(ep.size)]
    incoming = [(src, e) for src, dst, e in moves if dst == ep.index]
    recvs = [sum(src == r for src, _ in incoming) for r in range(ep.size)]
    received = ep.all_to_all(send, sends, recvs)
    arrived = {e: _new_expert(template, _from_bytes(received[i], like)) for i, (_, e) in enumerate(incoming)}
    mine = new.experts_of(ep.index)
    moe.experts = nn.ModuleDict({str(e): arrived[e] if e in arrived else moe.experts[str(e)] for e in mine})
    moe.dispatch = AllToAllDispatch(new, ep, tp)
    moe.local_ids = moe.dispatch.expert_ids
    if moe.gate_up is not None:  # restacked: the kept experts' views move into the new stacks
        moe.gate_up = moe.down = None
        moe.stack_experts()
    return received.numel()
