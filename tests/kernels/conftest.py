"""Kernel tests run the Triton kernels on CPU through the interpreter.

`TRITON_INTERPRET` is read when a kernel is decorated, i.e. when `kernels.triton_*` is first
imported; `kernels` itself never imports triton, so setting it here (before any test module of
this directory is imported) is early enough even if another directory imported triton first.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
