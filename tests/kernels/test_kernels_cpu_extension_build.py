"""The kernel cache (`kernels.cpu_extension_build`) as an attacker on the same machine meets it: a
library planted in the cache, or a built one modified, is refused before it is opened (its code
never runs) and built afresh; a cache directory of another user is refused; one left open to
others is closed; every build's hash is recorded and checked on each load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from kernels import cpu_extension_build as ceb

pytestmark = [
    pytest.mark.skipif(
        shutil.which(os.environ.get("CXX") or "c++") is None
        or not cpp_extension.is_ninja_available(),
        reason="no C++ compiler or ninja",
    ),
    pytest.mark.slow,  # each test runs the compiler
]

SOURCE = """
#include <pybind11/pybind11.h>
static int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""

PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen("%s", "w");
  if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


@pytest.fixture
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ceb.ExtensionSpec:
    monkeypatch.setenv(ceb.CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text(SOURCE)
    return ceb.ExtensionSpec(name="molora_test_tiny", source=source, cflags=("-O1",))


def _plant(tmp_path: Path, where: Path) -> Path:
    """Compile a library whose mere loading writes a marker file, at `where`."""
    marker = tmp_path / "marker"
    src = tmp_path / "planted.c"
    src.write_text(PLANTED % marker)
    cc = shutil.which(os.environ.get("CXX") or "c++") or "c++"
    subprocess.run([cc, "-x", "c", "-shared", "-fPIC", str(src), "-o", str(where)], check=True)
    return marker


def test_a_build_records_its_hash_and_a_load_verifies_it(spec: ceb.ExtensionSpec) -> None:
    assert ceb.load(spec).answer() == 42
    target = ceb.cache_root() / spec.module
    manifest = json.loads((target / ceb.MANIFEST).read_text())
    library = target / manifest["library"]
    assert manifest["sha256"] == ceb.sha256_file(library)
    assert ceb.verified_library(spec) == library
    for d in (ceb.cache_root(), target):
        assert d.stat().st_mode & 0o777 == 0o700


def test_a_modified_library_is_refused_unopened_and_rebuilt(
    spec: ceb.ExtensionSpec, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ceb.load(spec)
    library = ceb.verified_library(spec)
    assert library is not None
    marker = _plant(tmp_path, library)  # same name, the manifest untouched
    with pytest.raises(ceb.KernelIntegrityError, match="sha256"):
        ceb.verified_library(spec)
    with caplog.at_level(logging.ERROR, logger=ceb.__name__):
        assert ceb.load(spec).answer() == 42
    assert "refusing the cached" in caplog.text
    assert not marker.exists(), "the planted library was loaded"
    assert ceb.verified_library(spec) is not None  # the fresh build replaced it


def test_a_library_planted_without_a_build_is_refused(
    spec: ceb.ExtensionSpec, tmp_path: Path
) -> None:
    target = ceb.private_dir(ceb.cache_root() / spec.module)
    marker = _plant(tmp_path, target / f"{spec.module}.so")
    with pytest.raises(ceb.KernelIntegrityError, match="manifest"):
        ceb.verified_library(spec)
    # a manifest that points elsewhere is refused too
    (target / ceb.MANIFEST).write_text(
        json.dumps(
            {"module": spec.module, "library": "../x.so", "sha256": "0", "torch_version": "x"}
        )
    )
    with pytest.raises(ceb.KernelIntegrityError, match="another build"):
        ceb.verified_library(spec)
    assert ceb.load(spec).answer() == 42
    assert not marker.exists(), "the planted library was loaded"


def test_a_cache_left_open_is_closed_and_one_of_another_user_is_refused(
    tmp_path: Path,
) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    assert ceb.private_dir(open_dir).stat().st_mode & 0o777 == 0o700
    if os.getuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 4242, -1)
    with pytest.raises(ceb.KernelIntegrityError, match="uid 4242"):
        ceb.private_dir(foreign)


def test_a_symlinked_cache_entry_is_refused(spec: ceb.ExtensionSpec, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    ceb.private_dir(ceb.cache_root())
    (ceb.cache_root() / spec.module).symlink_to(elsewhere)
    with pytest.raises(ceb.KernelIntegrityError, match="not a directory"):
        ceb.verified_library(spec)


def test_a_second_builder_leaves_a_verified_build_in_place(spec: ceb.ExtensionSpec) -> None:
    ceb.load(spec)
    library = ceb.verified_library(spec)
    assert library is not None
    stamp = library.stat().st_mtime_ns
    assert ceb.build(spec).answer() == 42  # as a process racing the first would
    assert ceb.verified_library(spec) == library and library.stat().st_mtime_ns == stamp
    assert [p.name for p in ceb.cache_root().iterdir()] == [spec.module]  # no scratch left
