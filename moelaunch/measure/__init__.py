"""Measurement: `launch bench` (this engine against its peers, bench/), `launch report` (every optimization
method's speed, memory and quality, report/) and `launch eval` (the bundled model's task family scored
through the engine, scoring.py)."""
