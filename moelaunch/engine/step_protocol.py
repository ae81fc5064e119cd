"""What the engine's ranks send each other each step, as JSON bytes in tensors: no pickle on any wire
(torch's *_object collectives unpickle whatever arrives, so a stray peer could run code).

Rank 0's step command goes to every rank; each replica's reporter sends its tokens and stats back.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(buf: torch.Tensor) -> Any:
    return json.loads(buf.cpu().numpy().tobytes())


def broadcast_json(obj: Any, src: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    """obj (JSON-able, given on rank src) on every rank of group; src is a job rank."""
    mine = dist.get_rank() == src
    payload = _encode(obj, device) if mine else None
    size = torch.tensor([payload.numel() if mine else 0], dtype=torch.long, device=device)
    dist.broadcast(size, src, group=group)
    buf = payload if mine else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group=group)
    return obj if mine else _decode(buf)


def gather_json(obj: Any, dst: int, group: dist.ProcessGroup, device: torch.device) -> list[Any] | None:
    """Every rank's obj, in group rank order, on job rank dst (None elsewhere)."""
    payload = _encode(obj, device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.long, device=device), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    receiving = dist.get_rank() == dst
    bufs = [torch.empty_like(padded) for _ in sizes] if receiving else None
    dist.gather(padded, bufs, dst=dst, group=group)
    if not receiving:
        return None
    return [_decode(buf[: int(size.item())]) for buf, size in zip(bufs, sizes, strict=True)]
