"""Fail early, with the fix, when another distribution's top-level `kernels` shadows this project's.

transformers >= 5.25 depends on Hugging Face's `kernels` package, which installs a top-level
`kernels` module into site-packages; an entry point such as `launch` then imports that one instead of
this project's `kernels/` and fails later with a confusing AttributeError.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

OWN_KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def require_own_kernels() -> None:
    spec = importlib.util.find_spec("kernels")
    found = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if found != OWN_KERNELS:
        raise ImportError(
            f"`import kernels` finds {found or 'nothing'}, not moelaunch's {OWN_KERNELS}: another package "
            "named `kernels` (Hugging Face's, pulled in by transformers >= 5.25) shadows it. Fix: "
            "`pip uninstall kernels` and keep transformers < 5.25 (`pip install 'transformers<5.25'`)."
        )
