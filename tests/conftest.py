from __future__ import annotations

import os

# Triton picks interpreter vs compiled when a kernel is decorated; CPU-only test machines need the former.
os.environ.setdefault("TRITON_INTERPRET", "1")
