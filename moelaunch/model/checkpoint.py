"""Lazy reading of Hugging Face safetensors checkpoints, by tensor name and slice.

A directory holds `model.safetensors`, or several shards listed in `model.safetensors.index.json`.
Nothing is read until asked for, and a slice reads only its own bytes: this is what lets every rank
of a sharded deployment load just the part of each tensor it owns.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moelaunch.text.files import check_readable, read_text

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file or tensor at fault."""


class CheckpointReader:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self._handles: dict[str, object] = {}
        self.weight_map = self._weight_map()
        self.bytes_read = 0  # what this process actually pulled from disk (per-rank loading is measured)

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(read_text(index, "safetensors index"))["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e!r})") from e
            # Shards are files of this directory: an index naming ../x or /x would read elsewhere.
            outside = sorted({f for f in weight_map.values() if Path(f).name != f})
            if outside:
                raise CheckpointError(
                    f"{index} names shard file(s) outside {self.path}: {', '.join(outside)}; an index lists "
                    "plain file names of its own directory"
                )
            missing = sorted({f for f in weight_map.values() if not (self.path / f).exists()})
            if missing:
                example = next(n for n, f in weight_map.items() if f == missing[0])
                raise CheckpointError(
                    f"{self.path}: shard file(s) {', '.join(missing)} listed in {INDEX_FILE} are missing "
                    f"(they hold e.g. {example}); copy or re-download them"
                )
            for f in sorted(set(weight_map.values())):
                check_readable(self.path / f, "weights file")  # all now, not one at a time as they load
            return dict(weight_map)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path} holds no *.safetensors files and no {INDEX_FILE}")
        weight_map: dict[str, str] = {}
        for f in files:
            for name in self._open(f.name).keys():
                weight_map[name] = f.name
        return weight_map

    def _open(self, file: str):
        if file not in self._handles:
            check_readable(self.path / file, "weights file")  # safetensors calls a denied read "No such file"
            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{self.path / file} is not a readable safetensors file ({e})") from e
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, name: str) -> Path:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name} is not in the checkpoint at {self.path}")
        return self.path / self.weight_map[name]

    def _slice(self, name: str):
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name} is not in the checkpoint at {self.path}")
        try:
            return self._open(file).get_slice(name)
        except SafetensorError as e:
            raise CheckpointError(f"{self.path / file}: cannot read tensor {name} ({e})") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def is_fp8(self, name: str) -> bool:
        return self._slice(name).get_dtype() == "F8_E4M3"

    def read(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        dim: int = 0,
        start: int | None = None,
        end: int | None = None,
    ) -> torch.Tensor:
        """Tensor `name`, optionally only rows [start, end) along `dim`, converted to `dtype`."""
        sl = self._slice(name)
        rank = len(sl.get_shape())
        index = tuple(slice(start, end) if d == dim else slice(None) for d in range(rank))
        try:
            t = sl[index] if rank else sl[...]
        except (SafetensorError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{self.file_of(name)}: tensor {name} is corrupt or truncated ({e})") from e
        self.bytes_read += t.numel() * t.element_size()
        return t if dtype is None else t.to(dtype)

    def total_bytes(self) -> int:
        """Size of every tensor in the checkpoint (from the headers; nothing is read)."""
        sizes = {
            "F8_E4M3": 1,
            "BF16": 2,
            "F16": 2,
            "F32": 4,
            "I64": 8,
            "F64": 8,
            "I32": 4,
            "U8": 1,
            "BOOL": 1,
        }
        total = 0
        for name in self.weight_map:
            sl = self._slice(name)
            n = 1
            for d in sl.get_shape():
                n *= d
            total += n * sizes.get(sl.get_dtype(), 4)
        return total


# A rewritten checkpoint writes these itself; its other files (tokenizer, chat template, generation config)
# are copied. Weights and a run's training state (`.pt`) are never copied.
_REWRITTEN = {"config.json", INDEX_FILE}
_NOT_COPIED = {".safetensors", ".pt"}


def check_new_checkpoint_dir(src: str | Path, dst: str | Path) -> None:
    """Refuse to write a checkpoint into its source, or into a directory that already holds files: mixing
    with what is there (other shards, another index) would leave a checkpoint that no longer loads."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError(f"destination {dst} is the source checkpoint: choose a new directory")
    check_empty_destination(dst)


def check_empty_destination(dst: str | Path) -> None:
    """Refuse a destination that already holds files (another checkpoint would be overwritten, or mixed
    with this one): it must be new or an empty directory, and this user must be able to write it."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"destination {dst} exists and is not an empty directory: choose a new one")
    check_writable_dir(dst)


def check_writable_dir(dst: str | Path, what: str = "destination") -> None:
    """Refuse a directory this user cannot create or write into (read-only, or on a read-only mount)
    before any work: found at the first file written, it would leave a half-written directory."""
    dst = Path(dst)
    existing = dst
    while not os.path.lexists(existing):  # the directory, or the ancestor mkdir(parents=True) starts from
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {dst}: {existing} is a file, not a directory; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == dst else f"{existing}, where it would be created,"
        raise ValueError(
            f"{what} {dst}: {where} is not writable by this user (read-only directory or mount); "
            "choose a directory you can write, or fix its permissions"
        )


def copy_side_files(src: str | Path, dst: str | Path) -> None:
    """Copy a checkpoint's files other than its weights, config and index into a rewritten copy."""
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix not in _NOT_COPIED and f.name not in _REWRITTEN:
            shutil.copy2(f, Path(dst) / f.name)
