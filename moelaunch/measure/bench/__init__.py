"""`launch bench`: this engine against its peers on the same checkpoint, requests and machine.

workloads.py  the requests (offline throughput mix; fixed-length latency batches)
metrics.py    TTFT, TPOT, tok/s and peak memory from per-request timestamps, alike for every system
ours.py       this project's engine          hf_peer.py    transformers' generate (static batches)
vllm_peer.py  vLLM in its own venv, driving vllm_script.py there
suite.py      one run of every system        tables.py     tables and ratios
model.py      a random DeepSeek-V3 checkpoint that every peer accepts
"""
