"""cluster.yaml: every bad file gets one clear message naming the file and the key path; good files
round-trip; --set overrides land where they say."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moelaunch.launcher.deploy.config import (
    DEFAULT_CONFIG,
    BatchJob,
    ChatJob,
    DeployConfig,
    DeployConfigError,
    load_deploy_config,
)

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "configs" / "examples" / "deepseek-v3-2x8-h200.yaml"
BATCH = """\
model: m
parallel: {tp: 2, dp: 2, pp: 1}
cluster: {backend: ray, nodes: 2, devices_per_node: 2}
job: {mode: batch, input: prompts.jsonl, output: results.jsonl, max_tokens: 64}
"""

# (case, YAML text, --set overrides, pieces the one message must contain besides the file name)
BAD = [
    (
        "unknown key",
        "model: m\ncluster: {adress: h:1}\n",
        [],
        ["unknown key cluster.adress; did you mean address?"],
    ),
    ("unknown top key", "modle: m\n", [], ["unknown key modle; did you mean model?"]),
    (
        "unknown job key",
        "model: m\njob: {mode: chat, max_token: 5}\n",
        [],
        ["job.max_token; did you mean max_tokens?"],
    ),
    ("wrong type", "model: m\nparallel: {tp: '8'}\n", [], ["parallel.tp: given '8'; allowed: an integer"]),
    ("bad enum", "model: m\ndtype: bf16\n", [], ["dtype: given 'bf16'", "'bfloat16'", "'fp8'"]),
    ("negative tp", "model: m\nparallel: {tp: -2}\n", [], ["parallel.tp: given -2; allowed: a number >= 1"]),
    (
        "ep != dp*tp",
        "model: m\nparallel: {tp: 2, dp: 2, ep: 2}\n",
        [],
        ["parallel.ep: given 2", "dp*tp = 2*2 = 4"],
    ),
    ("missing model", "dtype: auto\n", [], ["model: required key missing", "config.json"]),
    (
        "YAML syntax",
        "model: m\nparallel: {tp: 2\ncluster: {}\n",
        [],
        ["YAML syntax error at line 3", "line 2"],
    ),
    (
        "duplicate key",
        "model: m\nparallel: {tp: 2}\nparallel: {dp: 2}\n",
        [],
        ["line 3", "duplicate key 'parallel'"],
    ),
    (
        "bad job mode",
        "model: m\njob: {mode: serv}\n",
        [],
        ["job.mode: given 'serv'", "chat, batch, bench, serve"],
    ),
    (
        "batch lacks output",
        "model: m\njob: {mode: batch, input: a}\n",
        [],
        ["job.output: required key missing"],
    ),
    ("section not a mapping", "model: m\nparallel: 8\n", [], ["parallel: given 8", "keys tp, dp, pp, ep"]),
    ("top level a list", "- model\n", [], ["(top level): given ['model']", "a mapping"]),
    (
        "unquoted slurm time",
        "model: m\ncluster: {slurm: {time: 1:00:00}}\n",
        [],
        ["cluster.slurm.time", "quoted"],
    ),
    (
        "fraction > 1",
        "model: m\ncluster: {memory_fraction: 1.5}\n",
        [],
        ["cluster.memory_fraction: given 1.5"],
    ),
    ("env name", "model: m\ncluster: {env: {'A B': x}}\n", [], ["cluster.env", "'A B'"]),
    (
        "placement entry",
        "model: m\nparallel: {expert_placement: [[0], [x]]}\n",
        [],
        ["expert_placement[1][0]"],
    ),
    (
        "local with 2 nodes",
        "model: m\ncluster: {nodes: 2}\n",
        [],
        ["cluster.nodes: given 2", "backend local"],
    ),
    ("address off ray", "model: m\ncluster: {address: 'h:6379'}\n", [], ["cluster.address: given 'h:6379'"]),
    ("bad --set path", BATCH, ["parallel.tpp=2"], ["parallel.tpp; did you mean tp?", "--set parallel.tpp=2"]),
    (
        "bad --set value",
        BATCH,
        ["job.temperature=hot"],
        ["job.temperature: given 'hot'", "--set job.temperature"],
    ),
    ("--set without =", BATCH, ["parallel.tp"], ["--set parallel.tp: expected KEY.PATH=VALUE"]),
    (
        "parallel beside disaggregation",
        "model: m\nparallel: {tp: 2}\ndisaggregation: {prefill: {}, decode: {}}\n",
        [],
        ["parallel: given 'a layout beside disaggregation'", "disaggregation.prefill.parallel"],
    ),
    (
        "disaggregation part of 2 ranks on local",
        "model: m\ndisaggregation: {prefill: {parallel: {tp: 2}}, decode: {}}\n",
        [],
        ["cluster.backend: given 'local'", "the prefill part has 2 ranks"],
    ),
    (
        "disaggregation lacks decode",
        "model: m\ndisaggregation: {prefill: {}}\n",
        [],
        ["disaggregation.decode: required key missing"],
    ),
    (
        "disaggregation with cluster nodes",
        "model: m\ndisaggregation: {prefill: {}, decode: {}}\ncluster: {backend: ray, nodes: 2}\n",
        [],
        ["cluster.nodes: given 2", "each part's nodes"],
    ),
    (
        "--set under a scalar",
        BATCH,
        ["cluster.nodes.x=1"],
        ["--set cluster.nodes.x=1: cluster.nodes is 2, not a mapping"],
    ),
]


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("case,text,overrides,pieces", BAD, ids=[c[0] for c in BAD])
def test_bad_file_gets_one_clear_message(tmp_path, case, text, overrides, pieces):
    path = write(tmp_path, text)
    with pytest.raises(DeployConfigError) as info:
        load_deploy_config(path, overrides)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for piece in pieces:
        assert piece in message, f"{case}: {piece!r} not in {message!r}"
    assert "Traceback" not in message and "pydantic" not in message


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(
        DeployConfigError, match="deployment file .*nowhere.yaml: no such file; give the path"
    ):
        load_deploy_config(tmp_path / "nowhere.yaml")


def test_several_problems_are_listed_one_per_line(tmp_path):
    path = write(tmp_path, "model: m\nparallel: {tp: 0, dp: x}\n")
    lines = str(pytest.raises(DeployConfigError, load_deploy_config, path).value).splitlines()
    assert len(lines) == 2 and all(line.startswith(str(path)) for line in lines)
    assert any("parallel.tp" in line for line in lines) and any("parallel.dp" in line for line in lines)


def test_example_loads_with_paths_resolved_against_its_directory():
    cfg = load_deploy_config(EXAMPLE)
    assert cfg.model == str(REPO / "configs" / "models" / "deepseek-v3-671b.json")
    assert (cfg.dtype, cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.ep) == (
        "fp8",
        8,
        2,
        1,
        None,
    )
    c = cfg.cluster
    assert (c.backend, c.address, c.nodes, c.devices_per_node, c.device) == ("ray", "auto", 2, 8, "cuda")
    assert c.env == {"NCCL_SOCKET_IFNAME": "eth0"} and c.timeouts.startup_s == 600
    assert (c.slurm.partition, c.slurm.time, c.slurm.gpus_per_node) == ("gpu", "04:00:00", 8)
    assert isinstance(cfg.job, BatchJob)
    assert cfg.job.input == str(EXAMPLE.parent / "prompts.jsonl")
    assert cfg.source == str(EXAMPLE)


def test_embedded_default_is_local_chat_on_the_bundled_model():
    cfg = load_deploy_config()
    assert cfg.source == str(DEFAULT_CONFIG)
    assert cfg.model == str(REPO / "checkpoints" / "small")
    assert (cfg.cluster.backend, cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.pp) == ("local", 1, 1, 1)
    assert isinstance(cfg.job, ChatJob)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_deploy_config(EXAMPLE)
    # Unset keys are left out, as a person writes the file: an explicit `server.api_key: null` is refused
    # (a server without a key comes from leaving the key out, never from an empty value).
    dumped = write(tmp_path, yaml.safe_dump(cfg.model_dump(exclude_none=True)), "again.yaml")
    again = load_deploy_config(dumped)
    assert again.model_dump() == cfg.model_dump()  # (== would also compare the source file)


def test_defaults_fill_a_minimal_file(tmp_path):
    cfg = load_deploy_config(write(tmp_path, "model: ckpt\n"))
    assert cfg.model == str(tmp_path / "ckpt")
    assert cfg.model_dump() == DeployConfig(model=str(tmp_path / "ckpt")).model_dump()
    assert cfg.job.mode == "chat" and cfg.cluster.address == "auto" and cfg.parallel.ep is None


def test_set_overrides(tmp_path, monkeypatch):
    path = write(tmp_path, BATCH)
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_deploy_config(
        path,
        [
            "parallel.tp=4",  # YAML scalar -> int
            "parallel.ep=8",
            "cluster.env.OMP_NUM_THREADS=4",  # env values become strings
            "engine.max_num_seqs=3",  # creates the section
            "cluster.timeouts.startup_s=30",
            "job.output=out/r.jsonl",  # a path typed on the command line: relative to the cwd
        ],
    )
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.engine.max_num_seqs) == (4, 8, 3)
    assert cfg.cluster.env == {"OMP_NUM_THREADS": "4"} and cfg.cluster.timeouts.startup_s == 30
    assert cfg.job.output == str(tmp_path.parent / "out" / "r.jsonl")
    assert cfg.job.input == str(tmp_path / "prompts.jsonl")


def test_set_job_mode_switches_modes_keeping_shared_keys(tmp_path):
    cfg = load_deploy_config(write(tmp_path, BATCH), ["job.mode=chat"])
    assert isinstance(cfg.job, ChatJob) and cfg.job.max_tokens == 64
    with pytest.raises(DeployConfigError, match=r"unknown key job.input\b.*--set job.input=x"):
        load_deploy_config(write(tmp_path, BATCH), ["job.mode=chat", "job.input=x"])


def test_error_helper_words_later_problems_the_same_way(tmp_path):
    cfg = load_deploy_config(write(tmp_path, BATCH), ["engine.max_model_len=9"])
    message = str(cfg.error("engine.max_model_len", 9, "<= 8"))
    given = "given 9 (from --set engine.max_model_len=9)"
    assert message == f"{tmp_path / 'cluster.yaml'}: engine.max_model_len: {given}; allowed: <= 8"


def test_the_issue_example_validates_as_written(tmp_path):
    text = """\
model: ./checkpoints/DeepSeek-V3      # HF dir
dtype: auto                           # auto | bfloat16 | float32 | fp8
parallel: {tp: 8, dp: 2, pp: 1}       # ep follows dp*tp unless given
cluster:
  backend: ray                        # local | ray | slurm
  address: auto                       # ray: auto (start embedded) or host:port of a running head
  nodes: 2
  devices_per_node: 8                 # GPUs, or CPU worker slots on CPU-only machines
  env: {NCCL_SOCKET_IFNAME: eth0}     # pushed to every worker
  timeouts: {startup_s: 600, collective_s: 600}
job: {mode: batch, input: prompts.jsonl, output: results.jsonl, max_tokens: 256, temperature: 0.6}
"""
    cfg = load_deploy_config(write(tmp_path, text))
    assert cfg.model == str(tmp_path / "checkpoints" / "DeepSeek-V3")
    assert (cfg.job.mode, cfg.job.max_tokens, cfg.job.temperature) == ("batch", 256, 0.6)


def test_slurm_and_k8s_refuse_a_disaggregated_deployment_naming_the_way(tmp_path, capsys):
    from moelaunch.launcher.cli import main

    path = write(
        tmp_path, f"model: {REPO / 'checkpoints/small'}\ndisaggregation: {{prefill: {{}}, decode: {{}}}}\n"
    )
    for command in (["slurm", str(path), "--dry-run"], ["k8s", str(path), "--image", "x"]):
        assert main(command) == 1
        assert "do not take disaggregated deployments yet" in capsys.readouterr().err
