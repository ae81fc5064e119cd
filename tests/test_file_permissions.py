"""Files this user may not read, and directories it may not write: one error naming the path, that it
is permission denied and the fix, before anything loads or is written (not "No such file", not a
traceback, not a half-written checkpoint)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from unprivileged import launch_unprivileged

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "checkpoints/small"


def checkpoint_denying(root: Path, denied: str | None) -> Path:
    """The bundled checkpoint as links, but for `denied`: a copy nobody may read."""
    ckpt = root / f"ckpt-{(denied or 'readable').replace('.', '-')}"
    ckpt.mkdir(parents=True)
    for f in BUNDLED.iterdir():
        if f.name == denied:
            shutil.copy(f, ckpt / f.name)
            (ckpt / f.name).chmod(0)
        else:
            (ckpt / f.name).symlink_to(f)
    return ckpt


def denied_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0)
    return path


def test_a_file_this_user_cannot_read_is_named_as_such(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    out = str(tmp_path / "o.jsonl")
    readable = checkpoint_denying(tmp_path, None)
    unsearchable = checkpoint_denying(tmp_path / "u", None)
    unsearchable.chmod(0o600)  # the directory lists no file to this user
    deploy = denied_file(tmp_path / "deploy.yaml", (REPO / "configs/local.yaml").read_text())
    batch_deploy = tmp_path / "batch.yaml"
    batch_deploy.write_text(yaml.safe_dump({
        "model": str(readable), "job": {"mode": "batch", "input": str(tmp_path / "in.jsonl"), "output": out}
    }))  # fmt: skip
    denied_file(tmp_path / "in.jsonl", '{"id": "a", "prompt": "hi"}\n')
    calibration = denied_file(tmp_path / "calib.txt", "hello\n")
    cases: list[tuple[list[str], Path]] = [
        (["plan", str(deploy)], deploy),
        ([str(deploy)], deploy),
        ([str(batch_deploy)], tmp_path / "in.jsonl"),
        (["batch", "--model", str(readable), "--input", str(denied_file(tmp_path / "d.jsonl", "")),
          "--output", out], tmp_path / "d.jsonl"),
        (["batch", "--model", str(unsearchable), "--input", str(prompts), "--output", out],
         unsearchable / "config.json"),
        (["prune", str(readable), str(tmp_path / "pruned"), "--experts", "4", "--n-group", "2",
          "--calibration", str(calibration)],
         calibration),
        (["distill", str(readable), str(tmp_path / "student"), "--layers", "2", "--experts", "4",
          "--n-group", "2", "--prompts", str(calibration)], calibration),
    ]  # fmt: skip
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]:
        ckpt = checkpoint_denying(tmp_path, name)
        cases.append((["batch", "--model", str(ckpt), "--input", str(prompts), "--output", out], ckpt / name))
    results = launch_unprivileged([argv for argv, _ in cases])
    for (argv, path), (code, err) in zip(cases, results, strict=True):
        assert code == 1, (argv, err)
        assert "cannot read" in err and f"{path}: permission denied" in err, (argv, err)
        assert "Traceback" not in err and "No such file" not in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "pruned").exists() and not (tmp_path / "student").exists()
    assert not Path(out).exists()


def test_writing_where_this_user_cannot_write_fails_first_and_writes_nothing(tmp_path):
    read_only = tmp_path / "ro"
    (read_only / "empty").mkdir(parents=True)
    (read_only / "empty").chmod(0o555)
    read_only.chmod(0o555)
    deploy = tmp_path / "deploy.yaml"
    job = {"mode": "batch", "input": "in.jsonl", "output": "out.jsonl"}
    deploy.write_text(yaml.safe_dump({"model": str(BUNDLED), "cluster": {"backend": "slurm"}, "job": job}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    new, empty = read_only / "new", read_only / "empty"
    cases: list[tuple[list[str], Path]] = [
        (["convert", "quantize-int8", str(BUNDLED), str(new)], new),
        (["convert", "quantize-int8", str(BUNDLED), str(empty)], empty),
        (["prune", str(BUNDLED), str(new), "--sparsity", "0.5"], new),
        (["distill", str(BUNDLED), str(new), "--layers", "2", "--experts", "4", "--n-group", "2"], new),
        (["bench", "--make-model", str(new)], new),
        (["report", "--out", str(new)], new),
        (["batch", "--model", str(BUNDLED), "--input", str(prompts), "--output", str(new)], new),
        (["slurm", str(deploy), "--script", str(new)], new),
        (["k8s", str(deploy), "--set", "cluster.device=cpu", "--set", "job.mode=serve", "--image", "x",
          "--output", str(new)], new),
    ]  # fmt: skip
    results = launch_unprivileged([argv for argv, _ in cases])
    for (argv, path), (code, err) in zip(cases, results, strict=True):
        assert code == 1, (argv, err)
        assert f" {path}: " in err and "is not writable" in err, (argv, err)
        assert "Traceback" not in err and err.count("\n") == 1, (argv, err)
    assert [p.name for p in read_only.iterdir()] == ["empty"] and not any(empty.iterdir())
