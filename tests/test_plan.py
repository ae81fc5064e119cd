"""The launch plan: rank placement, groups, stages, and memory figures checked against arithmetic done by
hand from the published DeepSeek-V3 shapes (not from plan.py's code)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from moelaunch.engine.build import EngineSpec
from moelaunch.launcher.cli import main
from moelaunch.launcher.deploy.config import DeployConfigError, load_deploy_config
from moelaunch.launcher.deploy.plan import build_plan
from moelaunch.launcher.jobs.run import engine_spec
from moelaunch.model.config import load_args
from moelaunch.model.expert_load_file import write_expert_load
from moelaunch.parallel.mesh import LayoutError
from moelaunch.parallel.placement_file import read_placement_file

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "configs" / "examples" / "deepseek-v3-2x8-h200.yaml"
V3 = str(REPO / "configs" / "models" / "deepseek-v3-671b.json")
TINY = str(REPO / "configs" / "models" / "tiny-v3.json")  # 4 layers (1 dense), 4 heads, 8 experts
GB = 10**9

# --- DeepSeek-V3 671B on 2 x 8 H200, tp 8, dp 2, pp 1, ep 16, fp8, by hand ----------------------------
# Shapes (SPEC-model.md): hidden 7168, vocab 129280, 61 layers of which 3 dense, 128 heads, q_lora 1536,
# kv_lora 512, qk_nope 128, qk_rope 64, v 128, dense inter 18432, expert inter 2048, 256 routed + 1 shared.
# fp8: projections 1 B/param + 4 B per 128x128 scale block (ceil on each side); embedding, lm_head, norms,
# gate 2 B (bf16); router bias 4 B. TP 8 slices heads, dense MLP, shared expert and vocab; EP 16 gives
# every rank 256/16 = 16 routed experts; q_a / kv_a projections, norms and the gate are replicated.
Q_A = 1536 * 7168 + (1536 // 128) * (7168 // 128) * 4  # replicated: 12 x 56 blocks
Q_A_NORM = 1536 * 2
Q_B = (128 * 192 // 8) * 1536 + (3072 // 128) * (1536 // 128) * 4  # 16 heads x (128 + 64): 24 x 12 blocks
KV_A = (512 + 64) * 7168 + 5 * 56 * 4  # 576 rows = 4.5 -> 5 row blocks
KV_A_NORM = 512 * 2
KV_B = (128 * (128 + 128) // 8) * 512 + (4096 // 128) * (512 // 128) * 4  # 32 x 4 blocks
O_PROJ = 7168 * (128 * 128 // 8) + 56 * (2048 // 128) * 4  # 56 x 16 blocks
LAYER_NORMS = 2 * 7168 * 2
ATTENTION = Q_A + Q_A_NORM + Q_B + KV_A + KV_A_NORM + KV_B + O_PROJ + LAYER_NORMS
DENSE_MLP = 3 * ((18432 // 8) * 7168 + (2304 // 128) * 56 * 4)  # gate, up, down: 18 x 56 blocks each
ROUTER = 256 * 7168 * 2 + 256 * 4  # gate weight bf16 + e_score_correction_bias fp32
SHARED = 3 * ((2048 // 8) * 7168 + 2 * 56 * 4)  # one shared expert, 2048/8 = 256 wide: 2 x 56 blocks
EXPERT = 3 * (2048 * 7168 + 16 * 56 * 4)  # one routed expert, whole: 16 x 56 blocks per matrix
EMBED = (129280 // 8) * 7168 * 2
HEAD = (129280 // 8) * 7168 * 2 + 7168 * 2  # lm_head slice + final norm
WEIGHTS = EMBED + 61 * ATTENTION + 3 * DENSE_MLP + 58 * (ROUTER + SHARED) + 58 * 16 * EXPERT + HEAD
KV = (512 + 64) * 2 * 61 * 131072 * 8  # latent + rope per token and layer, bf16, 131072 tokens x 8 seqs
# max_num_batched_tokens x hidden x bf16 x 16 buffers, plus latent-wide prefill buffers: 3 per step token
# and 2 per key of an 8192-key cached segment
ACTIVATIONS = 8192 * 7168 * 2 * 16 + (3 * 8192 + 2 * 8192) * 576 * 2


def test_hand_figures_themselves():
    assert EXPERT == 44_050_944 and ATTENTION == 36_676_448
    assert WEIGHTS == 44_260_854_816  # 44.26 GB
    assert KV == 73_685_532_672 and ACTIVATIONS == 1_926_234_112
    assert WEIGHTS + KV + ACTIVATIONS == 119_872_621_600  # 119.87 GB < 141 x 0.9 = 126.9 GB


def test_671b_on_2x8_h200_matches_the_hand_figures():
    plan = build_plan(load_deploy_config(EXAMPLE))
    assert (plan.dtype, plan.device, plan.mesh.world, plan.mesh.ep) == ("fp8", "cuda", 16, 16)
    for r in plan.ranks:  # pp 1: every rank holds the same amount
        assert (r.weight_bytes, r.kv_cache_bytes, r.activation_bytes) == (WEIGHTS, KV, ACTIVATIONS)
    parts = {p.name: p.nbytes(plan.dtype, plan.block) for p in plan.ranks[0].weight_parts}
    assert parts == {
        "embedding": EMBED,
        "attention + norms": 61 * ATTENTION,
        "dense MLP": 3 * DENSE_MLP,
        "router + shared experts": 58 * (ROUTER + SHARED),
        "routed experts": 58 * 16 * EXPERT,
        "final norm + lm_head": HEAD,
    }
    assert plan.device_bytes == 141 * GB and plan.usable_bytes == 126_900_000_000 and plan.fits


def test_671b_printed_plan_shows_the_pieces(capsys):
    assert main(["plan", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    for piece in [
        "routed experts per EP rank = 256/16 = 16",
        "routed experts: 58 MoE layers x 16 experts = 928 x 44,050,944 B = 40,879,276,032 B",
        "[2048 x 7168] = 14,680,064 x 1 B + 16 x 56 scales x 4 B = 14,683,648 B",
        "[24576/8 x 1536] = 4,718,592 x 1 B + 24 x 12 scales x 4 B = 4,719,744 B",
        "[129280/8 x 7168] = 115,834,880 x 2 B = 231,669,760 B",
        f"weights total: {WEIGHTS:,} B = 44.26 GB",
        "KV cache: 65,536 blocks x 1,124,352 B (block_size 16 tokens x (kv_lora_rank 512 + "
        "qk_rope_head_dim 64) x 2 B x 61 layers) = 73,685,532,672 B = 73.69 GB: the most it can use, "
        "max_num_seqs 8 x 8192 blocks",
        "total: 44.26 + 73.69 + 1.93 = 119.87 GB; usable 141.00 GB x 0.9 = 126.90 GB: fits",
    ]:
        assert piece in out, piece


def test_rank_table_and_groups():
    plan = build_plan(load_deploy_config(EXAMPLE))
    # rank = pp*(dp*tp) + dp*tp + tp; node = rank // 8; ep index within the stage = rank % 16
    r = plan.ranks[9]
    assert (r.rank, r.node, r.local_device, r.pp, r.dp, r.tp, r.ep) == (9, 1, 1, 0, 1, 1, 9)
    assert r.experts == tuple(range(144, 160)) and r.layers == tuple(range(61))
    assert plan.ranks[0].experts == tuple(range(16))
    assert [(x.node, x.local_device) for x in plan.ranks] == [(n, d) for n in range(2) for d in range(8)]
    groups = plan.groups()
    assert groups["tp"] == [list(range(8)), list(range(8, 16))]  # each inside one node
    assert groups["dp_replica"] == groups["tp"]
    assert groups["ep"] == [list(range(16))]
    assert groups["pp"] == [[i] for i in range(16)]


def plan_file(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(sections))
    return path


def v3_on(tmp_path: Path, parallel: dict, nodes: int, devices: int, **more) -> Path:
    cluster = {"backend": "ray", "nodes": nodes, "devices_per_node": devices, "device": "cuda"}
    cluster["device_memory_gb"] = 141
    return plan_file(tmp_path, model=V3, dtype="fp8", parallel=parallel, cluster=cluster, **more)


def test_pp2_layers_per_stage_and_ranks(tmp_path):
    engine = {"max_model_len": 4096, "max_num_seqs": 8}
    plan = build_plan(load_deploy_config(v3_on(tmp_path, {"tp": 4, "dp": 2, "pp": 2}, 2, 8, engine=engine)))
    # Stage weight ~ layer parameters: MoE layer ~11.51e9 (257 experts x 3 x 7168 x 2048 + attention),
    # dense ~0.58e9, embedding = head = 0.93e9. Stage 0 = embed + 3 dense + k MoE layers,
    # stage 1 = (58-k) MoE layers + head:
    # k = 29 gives 336.4e9 vs 334.6e9 (k = 28: 324.9e9 vs 346.1e9), so layers 0-31 and 32-60.
    assert plan.stages == [list(range(32)), list(range(32, 61))]
    r = plan.ranks[13]  # 13 = pp 1 * 8 + dp 1 * 4 + tp 1
    assert (r.node, r.local_device, r.pp, r.dp, r.tp, r.ep) == (1, 5, 1, 1, 1, 5)
    assert r.experts == tuple(range(160, 192))  # ep 8: 256/8 = 32 per rank
    assert r.kv_cache_bytes == (512 + 64) * 2 * 29 * 4096 * 8
    names = [p.name for p in r.weight_parts]
    assert "embedding" not in names and "final norm + lm_head" in names and "dense MLP" not in names
    assert "embedding" in [p.name for p in plan.ranks[0].weight_parts]
    assert plan.groups()["pp"][:2] == [[0, 8], [1, 9]]
    assert plan.groups()["ep"] == [list(range(8)), list(range(8, 16))]


def test_bf16_671b_on_2x8_caches_what_the_weights_leave_and_on_h100_does_not_fit(tmp_path, capsys):
    engine = {"max_model_len": 32768, "max_num_seqs": 32, "max_num_batched_tokens": 8192}
    path = v3_on(tmp_path, {"tp": 8, "dp": 2}, 2, 8, engine=engine)
    params = (
        (129280 // 8) * 7168 * 2  # embedding + lm_head slices
        + 7168  # final norm
        + 61 * (1536 * 7168 + 1536 + 3072 * 1536 + 576 * 7168 + 512 + 4096 * 512 + 7168 * 2048 + 2 * 7168)
        + 3 * 3 * 2304 * 7168
        + 58 * (256 * 7168 + 256 + 3 * 256 * 7168)
        + 58 * 16 * 3 * 2048 * 7168
    )
    weights = params * 2 + 58 * 256 * 2  # bf16, router bias fp32 (2 B more each)
    block = (512 + 64) * 2 * 61 * 16  # bf16 latent + rope, 61 layers, 16 tokens
    # H200: 32 sequences of 32K tokens would take 73.7 GB; the cache gets what is left, in whole blocks.
    plan = build_plan(load_deploy_config(path, ["dtype=bfloat16"]))
    blocks = (126_900_000_000 - weights - ACTIVATIONS) // block
    assert plan.ranks[0].weight_bytes == weights and plan.fits
    assert plan.kv_blocks == blocks and plan.ranks[0].kv_cache_bytes == blocks * block
    assert plan.engine_kv_budget == blocks * block and blocks * 16 // 32768 == 16  # 16 of the 32 sequences
    assert main(["plan", str(path), "--set", "dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert f"the KV cache holds {blocks * 16 / 32768:.1f} sequences of 32768 tokens" in out
    # H100: the weights alone pass the 72 GB usable; counted with one sequence's cache, it does not fit.
    h100 = ["dtype=bfloat16", "cluster.device_memory_gb=80"]
    assert not build_plan(load_deploy_config(path, h100)).fits
    assert main(["plan", str(path), "--set", h100[0], "--set", h100[1]]) == 1
    err = capsys.readouterr().err
    total = (weights + 2048 * block + ACTIVATIONS) / GB
    assert f"does not fit: rank 0 needs {total:.2f} GB" in err and "72.00 GB usable" in err
    assert "one sequence of max_model_len" in err and "engine.max_model_len" in err and str(path) in err


@pytest.mark.parametrize(
    "model,parallel,nodes,devices,expected",
    [
        (TINY, {"tp": 3}, 1, 3, "num_attention_heads=4 is not divisible by tp=3"),
        (V3, {"tp": 8, "dp": 3}, 3, 8, "n_routed_experts=256 is not divisible by ep=dp*tp=24"),
        (TINY, {"pp": 5}, 1, 5, "pp=5 exceeds num_hidden_layers=4"),
        (V3, {"tp": 8, "dp": 2}, 1, 8, "needs dp*pp*tp = 2*1*8 = 16 devices but the cluster has "
         "nodes*devices_per_node = 1*8 = 8: set cluster.nodes: 2"),
        (V3, {"tp": 8}, 2, 4, "parallel.tp=8 does not divide cluster.devices_per_node=4, so a TP group would "
         "straddle nodes"),
    ],
    ids=["heads % tp", "experts % ep", "pp > layers", "too few devices", "tp straddles nodes"],
)  # fmt: skip
def test_layouts_that_do_not_work(tmp_path, model, parallel, nodes, devices, expected):
    cluster = {"backend": "ray", "nodes": nodes, "devices_per_node": devices, "device_memory_gb": 141}
    path = plan_file(tmp_path, model=model, parallel=parallel, cluster=cluster)
    with pytest.raises(LayoutError) as info:
        build_plan(load_deploy_config(path))
    assert str(info.value).startswith(str(path)) and expected in str(info.value)


def tiny(tmp_path: Path, **more) -> Path:
    cluster = {"devices_per_node": 2, "device": "cpu", "device_memory_gb": 1}
    return plan_file(tmp_path, model=TINY, parallel={"tp": 2}, cluster=cluster, **more)


@pytest.mark.parametrize("parallel, nodes, per_node", [({"tp": 2}, 1, 2), ({"tp": 2, "dp": 2}, 2, 2)])
def test_devices_per_node_defaults_to_what_the_layout_needs(tmp_path, parallel, nodes, per_node):
    """A layout needs no devices_per_node line, as LLM(tp=2) needs none; a given one still counts."""
    cluster = {"backend": "ray", "nodes": nodes, "device": "cpu", "device_memory_gb": 1}
    cfg = load_deploy_config(plan_file(tmp_path, model=TINY, parallel=parallel, cluster=cluster))
    assert cfg.cluster.devices_per_node == per_node and build_plan(cfg).mesh.world == nodes * per_node
    given = plan_file(tmp_path, model=TINY, parallel=parallel, cluster={**cluster, "devices_per_node": 8})
    with pytest.raises(LayoutError, match="nodes\\*devices_per_node"):
        build_plan(load_deploy_config(given))


def test_cpu_auto_dtype_is_float32(tmp_path):
    plan = build_plan(load_deploy_config(tiny(tmp_path, engine={"max_model_len": 1024, "max_num_seqs": 2})))
    assert (plan.dtype, plan.device, plan.value_bytes) == ("float32", "cpu", 4)
    assert plan.ranks[1].kv_cache_bytes == (16 + 8) * 4 * 4 * 1024 * 2


def test_config_problems_found_by_the_plan_name_their_key(tmp_path):
    def error(*overrides: str) -> str:
        with pytest.raises(DeployConfigError) as info:
            build_plan(load_deploy_config(tiny(tmp_path), list(overrides)))
        return str(info.value)

    assert "dtype: given 'fp8'" in error("dtype=fp8") and "quantize-fp8" in error("dtype=fp8")
    assert "engine.max_model_len: given 4096" in error("engine.max_model_len=4096")  # tiny's limit: 1024
    assert "parallel.expert_placement: given '3 expert owner lists'" in error(
        "parallel.expert_placement=[[0],[1],[0]]"
    )
    assert "model: given '/nowhere'" in error("model=/nowhere")
    if not torch.cuda.is_available():
        message = error("cluster.device=cuda", "cluster.device_memory_gb=null")
        assert "cluster.device_memory_gb: given None" in message and "H200: 141" in message


def test_redundant_expert_copies_show_in_experts_per_rank(tmp_path):
    owners = "[[0,1],[0],[0],[0],[1],[1],[1],[1]]"  # expert 0 on both EP ranks
    cfg = load_deploy_config(tiny(tmp_path), [f"parallel.expert_placement={owners}"])
    plan = build_plan(cfg)
    assert plan.ranks[0].experts == (0, 1, 2, 3) and plan.ranks[1].experts == (0, 4, 5, 6, 7)
    assert plan.heaviest.rank == 1
    assert plan.max_model_len == 1024  # not given: the model's max_position_embeddings (1024), at most 8192


def test_eplb_plans_the_redundant_copies_and_refuses_what_cannot_split(tmp_path):
    eplb = "engine.eplb={window: 10, interval: 20, redundant_experts: 2}"
    plan = build_plan(load_deploy_config(tiny(tmp_path), [eplb]))
    assert [len(r.experts) for r in plan.ranks] == [5, 5]  # (8 + 2) / ep 2, once rebalanced
    with pytest.raises(DeployConfigError, match=r"engine.eplb: given .*do not split over ep=2"):
        build_plan(load_deploy_config(tiny(tmp_path), ["engine.eplb={redundant_experts: 3}"]))


def test_json_output(tmp_path, capsys):
    assert main(["plan", str(EXAMPLE), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["world"], data["ep"], data["fits"]) == (16, 16, True)
    assert data["ranks"][9]["node"] == 1 and data["ranks"][9]["experts"] == list(range(144, 160))
    assert data["ranks"][0]["total_bytes"] == WEIGHTS + KV + ACTIVATIONS
    assert data["groups"]["tp"] == [list(range(8)), list(range(8, 16))]


def skewed_load(path: Path) -> Path:
    """Measured-load file for the tiny model (MoE layers 1-3, 8 experts): one busy expert per layer."""
    counts = {1: [900, 300, 100, 50, 400, 100, 40, 110], 2: [10] * 7 + [1930], 3: [250] * 8}
    write_expert_load(path, 1000, counts)
    return path


def test_plan_with_expert_load_writes_a_placement_the_deployment_uses(tmp_path, capsys):
    cluster = {"backend": "ray", "nodes": 1, "devices_per_node": 4, "device": "cpu", "device_memory_gb": 1}
    config = plan_file(tmp_path, model=TINY, parallel={"dp": 4}, cluster=cluster)
    load, out = skewed_load(tmp_path / "load.json"), tmp_path / "placement.json"
    argv = ["plan", str(config), "--expert-load", str(load), "--redundant-experts", "4"]
    assert main([*argv, "--write-placement", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "8 routed + 4 redundant experts = 3 per EP rank; global" in printed
    # Layer 2's expert 7 takes 1930 of 2000 rows: contiguous gives rank 3 all of them, EPLB splits it 4
    # ways (one copy per rank), each rank then 1930/4 + 70/4 = 500 rows: perfectly even.
    rows = {line.split()[0]: line.split()[1:3] for line in printed.splitlines() if line[:9].strip().isdigit()}
    assert rows["2"] == ["3.88", "1.00"] and rows["3"] == ["1.00", "1.00"]
    assert float(rows["1"][1]) < float(rows["1"][0])
    # The same 4 ranks on 2 nodes: the tiny model's 2 expert groups go one to a node first.
    assert main([*argv, "--set", "cluster.nodes=2", "--set", "cluster.devices_per_node=2"]) == 0
    assert "hierarchical: 2 expert groups over 2 nodes" in capsys.readouterr().out

    args = load_args(TINY)
    written = read_placement_file(out, args, 4)
    layer2 = written[2]
    assert sorted(written) == [1, 2, 3] and layer2.owners[7] == (0, 1, 2, 3)
    plain = build_plan(load_deploy_config(config))
    placed = build_plan(load_deploy_config(config, [f"parallel.expert_placement_file={out}"]))
    for rank in placed.ranks:
        assert rank.layer_experts == {i: tuple(p.experts_of(rank.ep)) for i, p in written.items()}
        # Each layer holds 3 experts instead of 2: the copies' weights count.
        expert_part = next(p for p in rank.weight_parts if p.name == "routed experts")
        assert expert_part.count == 3 * 3
        one_expert = expert_part.unit_bytes(placed.dtype, placed.block)
        assert rank.weight_bytes - plain.ranks[rank.rank].weight_bytes == 3 * one_expert
    assert main(["plan", str(config), "--set", f"parallel.expert_placement_file={out}"]) == 0
    assert "3/layer (file)" in capsys.readouterr().out
    # What every rank gets: the placements in the engine spec, through the JSON it travels as.
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    shutil.copy(TINY, checkpoint / "config.json")
    cfg = load_deploy_config(config, [f"model={checkpoint}", f"parallel.expert_placement_file={out}"])
    spec = EngineSpec.from_json(engine_spec(cfg, build_plan(cfg)).to_json())
    assert spec.weights.layer_expert_placement == {
        str(i): [list(r) for r in p.owners] for i, p in written.items()
    }


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        ("[1, 2]", "format is 'list', not 'moelaunch-expert-load/1'"),
        (
            '{"format": "moelaunch-expert-load/1", "tokens": 5, "counts": {"1": [1, 2]}}',
            "layer 1 has 2 counts",
        ),
        (
            '{"format": "moelaunch-expert-load/1", "tokens": 5, "counts": {}}',
            "no counts for MoE layers [1, 2, 3]",
        ),
    ],
)
def test_bad_expert_load_file_is_one_clear_error(tmp_path, capsys, content, expected):
    load = tmp_path / "load.json"
    if content is not None:
        load.write_text(content)
    assert main(["plan", str(tiny(tmp_path)), "--expert-load", str(load)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and expected in error and str(load) in error


def test_bad_placement_file_is_refused_before_anything_loads(tmp_path):
    load, out = skewed_load(tmp_path / "load.json"), tmp_path / "placement.json"
    assert main(["plan", str(tiny(tmp_path)), "--expert-load", str(load), "--write-placement", str(out)]) == 0
    placed = [f"parallel.expert_placement_file={out}"]
    assert build_plan(load_deploy_config(tiny(tmp_path), placed)).layer_placements
    out.write_text(out.read_text().replace('"ep": 2', '"ep": 4'))
    with pytest.raises(
        DeployConfigError, match="expert_placement_file: given .*written for ep=4, but .* ep = dp.tp = 2"
    ):
        build_plan(load_deploy_config(tiny(tmp_path), placed))
    out.write_text(out.read_text().replace('"ep": 4', '"ep": 2'))
    out.write_text(out.read_text().replace('"layers": {"1"', '"layers": {"0"'))
    with pytest.raises(DeployConfigError, match="layer '0' is not a MoE layer"):
        build_plan(load_deploy_config(tiny(tmp_path), placed))
