"""What a step dispatches, seen from inside torch: every aten op and custom-op call, and the ones that
sync with the host or give data-dependent shapes.

`StepOps` is a TorchDispatchMode: it counts device ops (views and allocations without work excluded,
as they launch nothing) and records syncs; with strict=True the first sync raises. Dtype conversions are
counted too, with the elements they convert (`conversions`): `aten.to` is declared a view (it returns
its input when there is nothing to convert), so without this a conversion would pass unseen. The static decode
step runs under it strictly when MOELAUNCH_STRICT_DECODE=1 (the CI checks), and `launch bench
--step-profile` prints its counts.

What it cannot see: reads that never reach the dispatcher. On CPU tensors `.tolist()` and `.cpu()`
read memory directly; only the same code on CUDA (or torch.compile's fullgraph tracing, which refuses
them) shows them.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result is read on the host or whose output shape depends on tensor values.
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten._unique.default,
    aten._unique2.default,
    aten.equal.default,
    aten.is_nonzero.default,
}
# Allocations: no kernel runs (their fill, when there is one, is a separate op and counted).
NO_WORK = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


class SyncError(RuntimeError):
    pass


def _bool_index(func, args) -> bool:
    """aten.index / index_put with a boolean mask: the selected count is data-dependent."""
    if func not in (
        aten.index.Tensor,
        aten.index_put_.default,
        aten.index_put.default,
        aten._index_put_impl_.default,
    ):
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


def _conversion(func, args, out) -> tuple[str, int] | None:
    """("float32->bfloat16", elements) for an op that converts a tensor's dtype on the same device:
    `aten.to` that made a copy, or a copy_ between dtypes."""
    if func.overloadpacket is aten.copy_:
        dst, src = args[0], args[1]
    elif func.overloadpacket in (aten.to, aten._to_copy) and isinstance(out, torch.Tensor):
        dst, src = out, args[0]
    else:
        return None
    if src.dtype == dst.dtype or src.device != dst.device:
        return None
    return f"{str(src.dtype).removeprefix('torch.')}->{str(dst.dtype).removeprefix('torch.')}", src.numel()


def _to_host(func, args, kwargs, out) -> bool:
    """A copy from an accelerator into CPU memory."""
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    if func is aten._to_copy.default and isinstance(out, torch.Tensor):
        return out.device.type == "cpu" and args[0].device.type != "cpu"
    return False


class StepOps(TorchDispatchMode):
    """Counts the ops dispatched while active: `ops` (Counter by op name), `syncs` (list of names),
    `conversions` (calls per "src->dst" dtype pair) and `converted` (elements per pair)."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict
        self.ops: Counter[str] = Counter()
        self.syncs: list[str] = []
        self.conversions: Counter[str] = Counter()
        self.converted: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__ if func.namespace == "aten" else func)
        if func in SYNC_OPS or _bool_index(func, args):
            self._sync(name)
        out = func(*args, **kwargs)
        if _to_host(func, args, kwargs, out):
            self._sync(f"{name} to the host")
        converts = _conversion(func, args, out)
        if converts is not None:
            self.conversions[converts[0]] += 1
            self.converted[converts[0]] += converts[1]
        if (not func.is_view or converts is not None) and func not in NO_WORK:
            self.ops[name] += 1
        return out

    def _sync(self, name: str) -> None:
        self.syncs.append(name)
        if self.strict:
            raise SyncError(f"{name} in a step that must not sync with the host or depend on values")
