"""The one list of C++ kernels (`kernels.registry`) is what everything iterates: it names every
source under `kernels/csrc` and only those, each wrapper builds exactly its entry, the Makefile
and both images build through it without naming a kernel themselves, `list` prints the
wrappers, and every listed kernel is built wherever this machine can build it."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from kernels import cpu_kernel, registry

REPO = Path(__file__).resolve().parents[2]
BUILDERS = [REPO / "Makefile", REPO / "Dockerfile", REPO / "docker" / "cpu.Dockerfile"]


def test_the_registry_lists_every_source_once() -> None:
    listed = [kernel.source for kernel in registry.KERNELS]
    assert sorted(listed) == sorted(p.name for p in registry.CSRC.glob("*.cpp"))
    assert len({kernel.name for kernel in registry.KERNELS}) == len(registry.KERNELS)


@pytest.mark.parametrize("kernel", registry.KERNELS, ids=lambda k: k.name)
def test_each_wrapper_builds_its_entry(kernel: registry.KernelSource) -> None:
    wrapper = importlib.import_module(kernel.wrapper)
    assert wrapper.KERNEL.spec == kernel.spec()
    assert wrapper.SWITCH_ENV == wrapper.KERNEL.switch_env == kernel.switch_env
    assert (wrapper.KERNEL.title, wrapper.KERNEL.fallback) == (kernel.title, kernel.fallback)


@pytest.mark.parametrize("path", BUILDERS, ids=lambda p: p.name)
def test_the_makefile_and_both_images_build_through_the_registry(path: Path) -> None:
    text = path.read_text()
    assert re.search(r"(python|\$\(PY\)) -m kernels\.registry build", text)
    assert not re.search(r"-m kernels\.cpu_", text), "a kernel named outside the registry"


def test_list_prints_the_wrappers() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kernels.registry", "list"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert run.stdout.split() == [kernel.wrapper for kernel in registry.KERNELS]


@pytest.mark.parametrize("kernel", registry.KERNELS, ids=lambda k: k.name)
def test_every_kernel_is_built_wherever_it_can_run(
    kernel: registry.KernelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(kernel.switch_env, raising=False)
    can_build = (
        cpu_kernel.cpu_supported()
        and cpu_kernel.compiler() is not None
        and cpp_extension.is_ninja_available()
    )
    assert importlib.import_module(kernel.wrapper).KERNEL.available() == can_build
