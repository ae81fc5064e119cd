"""The decode step as docs/architecture.md draws it: one process's step crosses few package boundaries
and never calls back up a layer (measured with sys.setprofile, not read from the imports)."""

from __future__ import annotations

from pathlib import Path

from moelaunch.engine.llm import LLM
from moelaunch.measure.step_trace import layer_order, trace_decode_step


def test_a_single_process_decode_step_only_calls_down(one_torch_thread):
    llm = LLM(model=str(Path(__file__).parents[1] / "checkpoints" / "small"), max_num_seqs=4)
    try:
        files, crossings = trace_decode_step(llm, batch=4)
    finally:
        llm.shutdown()
    order = layer_order()
    entered = {"engine/engine.py", "engine/model_runner.py", "model/transformer.py", "model/moe.py"}
    assert entered <= set(files)
    assert any(f.startswith("kernels/") for f in files)
    upward = [pair for pair in crossings if order[pair[1]] < order[pair[0]]]
    assert not upward, f"calls back up a layer: {upward}"
    assert len(crossings) <= 4, crossings
