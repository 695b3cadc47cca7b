"""GPU checks (`@gpu`, see gpu_support.py); scripts/gpu_check.sh runs them without pytest.

The repo root goes first on sys.path: `tests/conftest.py` puts `tests/` there, where
`tests/kernels/` would otherwise be found as a namespace package named `kernels`, shadowing the
real one (a project-wide `pythonpath = ["."]` in the pytest settings is the lasting fix).
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
if getattr(sys.modules.get("kernels"), "__file__", "") is None:  # namespace shadow imported
    del sys.modules["kernels"]
