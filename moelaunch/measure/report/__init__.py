"""`launch report`: every optimization method measured in one run, for speed, memory and answer quality.

methods.py  the methods: engine options, or a checkpoint a `launch` tool derives from the model
probes.py   the fixed prompts quality is compared on, and the baseline's answers to them
measure.py  one method in its own process: latency, throughput, peak memory, accuracy, logit drift
render.py   the table, report.json, report.md and report.png
"""
