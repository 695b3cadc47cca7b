"""Kernel tests run the Triton kernels on CPU through the interpreter.

`TRITON_INTERPRET` is read when `triton` is first imported (its library's jit functions are
decorated then) and when a kernel is decorated. On a machine without CUDA the root conftest
sets it before any test module is collected; here it is set for a CUDA machine too, where
these tests still run interpreted (tests/gpu runs the compiled kernels).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
