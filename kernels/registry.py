"""Every C++ CPU kernel of the project, listed once: its source under `kernels/csrc`, the Python
module that wraps it, its on/off switch and what runs where it cannot.

The wrappers (`kernels.cpu_*`) build their kernel from this list, and everything that builds or
checks the kernels iterates it rather than naming them again: `make models` and both images run
`python -m kernels.registry build` (build every kernel ahead, into the user's private cache),
and the tests hold the list, `kernels/csrc` and the wrappers equal.

    python -m kernels.registry list      # the wrapper modules, one a line
    python -m kernels.registry sources   # the C++ sources, one a line
    python -m kernels.registry build     # build and verify every kernel (exits 0 where one
                                         # cannot be built here, after saying why)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

from kernels.cpu_extension_build import AVX2_OPENMP_CFLAGS, OPENMP_LDFLAGS, ExtensionSpec

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class KernelSource:
    """One kernel: the extension module `name` built from `csrc/<source>` with `cflags` and
    `ldflags`, wrapped by Python module `wrapper`; `switch_env=0` turns it off, `title` names it
    in logs and `fallback` says what its callers run instead."""

    name: str
    source: str
    wrapper: str
    switch_env: str
    title: str
    fallback: str
    cflags: tuple[str, ...] = AVX2_OPENMP_CFLAGS
    ldflags: tuple[str, ...] = OPENMP_LDFLAGS

    @property
    def path(self) -> Path:
        return CSRC / self.source

    def spec(self) -> ExtensionSpec:
        """What `kernels.cpu_extension_build` builds and verifies for this kernel."""
        return ExtensionSpec(self.name, self.path, self.cflags, self.ldflags)


PANEL_GEMM = KernelSource(
    "molora_panel_gemm", "panel_gemm.cpp", "kernels.cpu_panel_gemm", "MOLORA_CPU_PANEL_GEMM",
    "CPU panel GEMM", "its shapes run on oneDNN or F.linear",
)  # fmt: skip
PAGED_DECODE = KernelSource(
    "molora_paged_decode", "paged_decode.cpp", "kernels.cpu_paged_attention",
    "MOLORA_CPU_PAGED_ATTENTION", "CPU paged attention", "decode gathers blocks",
)  # fmt: skip
TOPK_ROUTE = KernelSource(
    "molora_topk_route", "topk_route.cpp", "kernels.cpu_topk_route", "MOLORA_CPU_TOPK_ROUTE",
    "CPU top-k route", "the gate runs PyTorch ops", cflags=("-O3", "-mavx2", "-mfma"),
)  # fmt: skip
TOPK_DELTA = KernelSource(
    "molora_topk_delta", "topk_delta.cpp", "kernels.cpu_topk_delta", "MOLORA_CPU_TOPK_DELTA",
    "CPU grouped top-k LoRA delta", "the LoRA delta runs the stacked PyTorch path",
)  # fmt: skip
KERNELS: tuple[KernelSource, ...] = (PANEL_GEMM, PAGED_DECODE, TOPK_ROUTE, TOPK_DELTA)


def build_all() -> int:
    """Build (or load the verified build of) every kernel, each through its wrapper, so a
    kernel's own load-time check runs too; 0 even where one cannot be built here."""
    for kernel in KERNELS:
        importlib.import_module(kernel.wrapper).KERNEL.build_ahead()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("action", choices=["list", "sources", "build"])
    action = parser.parse_args(argv).action
    if action == "build":
        return build_all()
    for kernel in KERNELS:
        print(kernel.wrapper if action == "list" else kernel.path.relative_to(CSRC.parents[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
