"""Checkpoint reading: sharded directories, lazy slices, and an error that names the culprit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_model

from moelaunch.model import CheckpointError, CheckpointReader, load_model
from moelaunch.model.checkpoint import INDEX_FILE


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("tiny"), "v3")


def shard(src, dst, n_files: int = 3):
    """Rewrite a one-file checkpoint as n shards plus an index, the way large checkpoints ship."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_files):
        file = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_files]}
        save_file(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_sharded_checkpoint_gives_the_same_model(tiny_dir, tmp_path):
    sharded = shard(tiny_dir, tmp_path / "sharded")
    ids = torch.arange(2, 18)[None]
    assert torch.equal(load_model(sharded)(ids), load_model(tiny_dir)(ids))


def test_slices_read_only_the_asked_rows(tiny_dir):
    reader = CheckpointReader(tiny_dir)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    full = reader.read(name)
    assert torch.equal(reader.read(name, dim=0, start=32, end=64), full[32:64])
    assert torch.equal(reader.read(name, dim=1, start=4, end=12), full[:, 4:12])
    assert reader.read(name, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_missing_shard_names_the_file(tiny_dir, tmp_path):
    sharded = shard(tiny_dir, tmp_path / "sharded")
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors.*missing"):
        load_model(sharded)


def test_corrupt_shard_names_the_file(tiny_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(bad)


def test_wrong_shape_names_tensor_and_file(tiny_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.2.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: tensor model.layers.2.self_attn.o_proj.weight"
    ):
        load_model(bad)


@pytest.mark.parametrize(
    "change, message", [(2, "tensor model.layers.2.* is not part"), (4, "model.layers.3.* missing")]
)
def test_config_that_does_not_match_the_tensors(tiny_dir, tmp_path, change, message):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_hidden_layers"] = change
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


def test_empty_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(json.loads(open("configs/models/tiny-v3.json").read())))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_mtp_weights_load_when_present_and_are_optional(tiny_dir, tmp_path):
    assert len(load_model(tiny_dir).mtp) == 0  # config says 1 MTP layer, transformers wrote none
    with_mtp = tmp_path / "mtp"
    shutil.copytree(tiny_dir, with_mtp)
    tensors = load_file(with_mtp / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:  # an MoE block as the MTP block
        tensors[name.replace("layers.2.", "layers.3.")] = tensors[name] + 0.01
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.3.{norm}.weight"] = torch.ones(64)
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(64, 128) * 0.05
    tensors["model.layers.3.embed_tokens.weight"] = tensors[
        "model.embed_tokens.weight"
    ].clone()  # a shared copy
    save_file(tensors, with_mtp / "model.safetensors")
    model = load_model(with_mtp)
    assert len(model.mtp) == 1
    hidden = model.hidden_states(torch.arange(2, 10)[None])
    assert model.mtp_logits(hidden, torch.arange(3, 11)[None]).shape == (1, 8, 320)
    assert len(load_model(with_mtp, with_mtp=False).mtp) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_named_at_load(tiny_dir, tmp_path, caplog, bad):
    """A checkpoint with a NaN or inf weight once ran to the end with every token 0 and exit 0."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    tensors[name][0, 0] = bad
    save_file(tensors, broken / "model.safetensors")
    with caplog.at_level("WARNING"):
        load_model(broken)
    assert f"holds NaN or inf values in 1 tensor(s) ({name})" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_model(tiny_dir)
    assert "NaN or inf" not in caplog.text  # a healthy checkpoint says nothing


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/dir.safetensors"])
def test_an_index_naming_files_outside_the_checkpoint_is_refused(tiny_dir, tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": shard}}))
    with pytest.raises(CheckpointError, match="outside"):
        CheckpointReader(ckpt)
