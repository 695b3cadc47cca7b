"""A C++ CPU kernel that callers can do without: an on/off switch, a verified build loaded once
per process, and the build-ahead command that `make models` and the image run.

Where the kernel is switched off, the CPU lacks AVX2/FMA, or it cannot be built (no compiler, no
ninja, a compile error), `available()` is False, the reason is logged once, and callers keep
their PyTorch path (`fallback` names it).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kernels import cpu_extension_build
from kernels.cpu_extension_build import ExtensionSpec
from kernels.registry import KernelSource

log = logging.getLogger(__name__)


@functools.cache
def cpu_supported() -> bool:
    """Whether this CPU runs the AVX2/FMA kernels (asked once: the CPU does not change)."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return False
    return torch.backends.cpu.get_cpu_capability() in {"AVX2", "AVX512"}


def compiler() -> str | None:
    """The C++ compiler `torch.utils.cpp_extension` will use, if there is one."""
    return shutil.which(os.environ.get("CXX") or "c++")


_namespaces = itertools.count()  # numbers the ops namespaces this process registers


def ops_of(library: ModuleType, name: str) -> Any:
    """The `torch.ops` namespace of `library`'s ops, registered on the first ask under a name
    no other library loaded in this process has (a source built twice, say into another
    cache, loads as a second library whose ops must not collide with the first's); None for a
    library without ops."""
    register = getattr(library, "register_ops", None)
    if register is None:
        return None
    return getattr(torch.ops, register(f"{name}_{next(_namespaces)}"))


@dataclass(eq=False)
class CpuKernel:
    """One kernel: `spec` built on first use (or its verified build loaded), `switch_env=0`
    turns it off, `check` refuses a library that does not match its Python side. A failed
    build is logged once and remembered: no retry per call."""

    spec: ExtensionSpec
    title: str
    fallback: str
    switch_env: str
    check: Callable[[ModuleType], None] | None = None  # raises RuntimeError on a wrong library
    _library: ModuleType | None = field(default=None, init=False, repr=False)
    _ops: Any = field(default=None, init=False, repr=False)  # its `torch.ops` namespace
    _attempted: bool = field(default=False, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def of(
        cls, source: KernelSource, check: Callable[[ModuleType], None] | None = None
    ) -> CpuKernel:
        """The kernel `source` of `kernels.registry`; `check` refuses a wrong library."""
        return cls(source.spec(), source.title, source.fallback, source.switch_env, check)

    def build(self) -> ModuleType:
        """The extension module: the verified cached build, else a fresh one. Raises
        RuntimeError with the reason (no compiler, no ninja, the compiler's output)."""
        if compiler() is None:
            raise RuntimeError("no C++ compiler found (set CXX or install g++)")
        lib = cpu_extension_build.load(self.spec)
        if self.check is not None:
            self.check(lib)
        return lib

    def library(self) -> ModuleType | None:
        """The module, built or loaded on the first call; None where it cannot be."""
        if self._attempted:
            return self._library
        with self._lock:
            if not self._attempted:
                try:
                    self._library = self.build()
                    self._ops = ops_of(self._library, self.spec.name)
                except (OSError, RuntimeError) as exc:  # the build's own errors are RuntimeErrors
                    log.warning("%s unavailable, %s: %s", self.title, self.fallback, exc)
                self._attempted = True
        return self._library

    def ops(self) -> Any:
        """The kernel's ops (`torch.ops.<namespace>`: each takes tensors and checks them in
        C++), the library built or loaded on the first call; None where it cannot be."""
        if self._ops is None and not self._attempted:  # a served call pays one attribute read
            self.library()
        return self._ops

    def available(self) -> bool:
        """Whether the kernel is on and runs here (builds the library on the first call)."""
        if os.environ.get(self.switch_env, "1") == "0" or not cpu_supported():
            return False
        return self.library() is not None

    def build_ahead(self) -> int:
        """`python -m <kernel module>`: build now. Exits 0 where the kernel cannot be built
        here (callers then run their fallback) after saying why, loudly."""
        logging.basicConfig(level=logging.INFO)
        if not cpu_supported():
            print(f"{self.title}: this CPU has no AVX2/FMA; {self.fallback}", file=sys.stderr)
            return 0
        try:
            lib = self.build()
        except RuntimeError as exc:
            print(f"WARNING: {self.title} not built ({exc}); {self.fallback}", file=sys.stderr)
            return 0
        print(f"{self.title} built and verified: {lib.__file__}")
        return 0
