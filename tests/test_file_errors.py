"""Files a user points at, wrong in every way a file can be: one error naming the file and what is wrong,
never a traceback, before any model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moelaunch.launcher.cli import main
from moelaunch.model.config import ConfigError, load_args

BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints/small"
REPO = BUNDLED.parents[1]


def broken_checkpoint(tmp_path: Path, file: str, change) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(BUNDLED, ckpt)
    change(ckpt / file)
    return ckpt


def edit_json(key: str, value) -> callable:
    def change(path: Path) -> None:
        data = json.loads(path.read_text())
        data[key] = value
        path.write_text(json.dumps(data))

    return change


@pytest.mark.parametrize(
    "file, change, says",
    [
        ("config.json", edit_json("hidden_size", None), "config.json: hidden_size: given None"),
        ("config.json", edit_json("hidden_size", "big"), "config.json: hidden_size: given 'big'"),
        ("config.json", edit_json("num_hidden_layers", -1), "config.json: num_hidden_layers: given -1"),
        ("config.json", lambda p: p.write_bytes(b"\xff\xfe"), "config.json: not UTF-8 text"),
        ("tokenizer.json", lambda p: p.write_text("{broken"), "tokenizer.json: not a tokenizer"),
        ("tokenizer_config.json", edit_json("chat_template", "{{ m | nosuchfilter }}"),
         "tokenizer_config.json: its chat_template does not compile"),
    ],
)  # fmt: skip
def test_a_broken_checkpoint_file_is_named(tmp_path, capsys, file, change, says):
    ckpt = broken_checkpoint(tmp_path, file, change)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    assert (
        main(["batch", "--model", str(ckpt), "--input", str(prompts), "--output", str(tmp_path / "o")]) == 1
    )
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["batch", "--model", str(BUNDLED / "model.safetensors"), "--input", "{p}", "--output", "{o}"],
         "is a weights file: give the checkpoint directory"),
        (["batch", "--model", str(BUNDLED), "--input", "{d}", "--output", "{o}"], "is a directory;"),
        (["plan", "{d}"], "is a directory"),
        (["plan", "{b}"], "not UTF-8 text"),
    ],
)  # fmt: skip
def test_a_wrong_file_given_on_the_command_line_is_named(tmp_path, capsys, argv, says):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    (tmp_path / "b.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "d").mkdir()
    names = {
        "p": tmp_path / "p.jsonl",
        "o": tmp_path / "o.jsonl",
        "d": tmp_path / "d",
        "b": tmp_path / "b.yaml",
    }
    assert main([a.format(**names) for a in argv]) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_as_config_json_are_a_config_error_naming_it(tmp_path, data):
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(ConfigError, match="config.json"):
        load_args(tmp_path)


# Values a JSON line of a prompt file may hold where a prompt or a conversation goes.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["role", "content", "x"]), inner)
    ),
    max_leaves=8,
)
prompt_lines = st.lists(
    st.fixed_dictionaries({}, optional={"prompt": json_values, "messages": json_values}).map(json.dumps)
    | st.text(max_size=30),
    max_size=4,
).map(lambda lines: "\n".join(lines).encode())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200) | prompt_lines, suffix=st.sampled_from([".jsonl", ".txt"]))
def test_any_bytes_as_a_prompt_file_are_prompts_or_an_error_naming_it(tmp_path, data, suffix):
    """`prune --calibration` and `distill --prompts` files: token ids, or one ValueError naming the file."""
    from moelaunch.tools.calibration import calibration_sequences

    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(data)
    try:
        sequences = calibration_sequences(BUNDLED, path)
    except ValueError as e:
        assert str(path) in str(e)
    else:
        assert sequences and all(isinstance(t, int) for s in sequences for t in s)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["convert", "quantize-int8", str(BUNDLED), "/proc/none/x"], "/proc/none: No such file"),
        (["slurm", str(REPO / "configs/local.yaml"), "--script", "/proc/cpuinfo"], "/proc/cpuinfo: cannot"),
    ],
)
def test_a_path_the_system_refuses_is_one_line_naming_it(capsys, argv, says):
    """Paths no check foresees (a directory that cannot be made, a file a write fails on) still give one
    line naming the path, not an errno or a traceback."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "[Errno" not in err
