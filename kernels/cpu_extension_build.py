"""Build a C++ kernel as a PyTorch extension into a cache private to the user, and load a cached
library only after its sha256 matches the one recorded when this code built it.

The library is built by `torch.utils.cpp_extension.load` (ninja and the system C++ compiler),
at `make models`, at image build, or at first use. The cache directory must be owned by this user
and closed to everyone else (0700): a library someone else could have written is never trusted.
Each build records the library's hash in a manifest beside it; a library whose bytes differ from
the manifest (planted, modified, half-written) is refused before it is opened, and built afresh.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from pydantic import BaseModel, ValidationError
from torch.utils import cpp_extension

log = logging.getLogger(__name__)

CACHE_ENV = "MOLORA_KERNEL_CACHE"
MANIFEST = "manifest.json"
# Every CPU kernel here: AVX2/FMA tiles (AVX-512 ones only by function attribute), OpenMP threads.
AVX2_OPENMP_CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
OPENMP_LDFLAGS = ("-fopenmp",)
_lock = threading.Lock()


class KernelIntegrityError(RuntimeError):
    """A cached library or its directory cannot be trusted."""


class Manifest(BaseModel):
    """What a build produced: the module it defines and its library's sha256."""

    module: str
    library: str
    sha256: str
    torch_version: str


@dataclass(frozen=True)
class ExtensionSpec:
    """One C++ source built with fixed flags; the source, flags and torch version name the build."""

    name: str
    source: Path
    cflags: tuple[str, ...] = AVX2_OPENMP_CFLAGS
    ldflags: tuple[str, ...] = OPENMP_LDFLAGS

    @property
    def module(self) -> str:
        digest = hashlib.sha256(self.source.read_bytes())
        digest.update(" ".join((*self.cflags, "|", *self.ldflags, torch.__version__)).encode())
        return f"{self.name}_{digest.hexdigest()[:16]}"


def cache_root() -> Path:
    """`$MOLORA_KERNEL_CACHE`, else `~/.cache/molora/kernels`."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "molora" / "kernels"


def private_dir(path: Path) -> Path:
    """`path` as a directory owned by this user and closed to others (created 0700; a directory
    of ours left open is closed; one owned by someone else is refused)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise KernelIntegrityError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise KernelIntegrityError(f"{path} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(spec: ExtensionSpec) -> ModuleType:
    """Compile `spec` into a fresh private directory, record its hash, return the module.
    Raises RuntimeError (with the compiler's message) where it cannot be built."""
    root = private_dir(cache_root())
    target = root / spec.module
    scratch = Path(tempfile.mkdtemp(prefix=f".{spec.module}.", dir=root))  # 0700, never reused
    try:
        try:
            module = cpp_extension.load(
                name=spec.module,
                sources=[str(spec.source)],
                extra_cflags=list(spec.cflags),
                extra_ldflags=list(spec.ldflags),
                build_directory=str(scratch),
                verbose=False,
            )
        except (subprocess.SubprocessError, OSError, ImportError) as exc:
            raise RuntimeError(f"building {spec.name} failed: {exc}") from exc
        libraries = list(scratch.glob(f"{spec.module}*.so"))
        if len(libraries) != 1:
            raise RuntimeError(f"the build of {spec.module} left {len(libraries)} libraries")
        (library,) = libraries
        manifest = Manifest(
            module=spec.module,
            library=library.name,
            sha256=sha256_file(library),
            torch_version=torch.__version__,
        )
        (scratch / MANIFEST).write_text(manifest.model_dump_json())
        if not _holds_a_verified_build(spec):  # another process may have just put one there
            shutil.rmtree(target, ignore_errors=True)  # a refused build or a stale one
        # atomic: readers see a whole build or none; on failure another process just put its
        # own (equal) build in place
        with contextlib.suppress(OSError):
            os.rename(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return module


def verified_library(spec: ExtensionSpec) -> Path | None:
    """The cached library of `spec` if its bytes match its manifest; None if there is none.
    Raises KernelIntegrityError for a library that does not match (or a manifest that lies)."""
    target = cache_root() / spec.module
    if not target.exists():
        return None
    private_dir(target.parent)
    private_dir(target)
    try:
        manifest = Manifest.model_validate_json((target / MANIFEST).read_text())
    except (OSError, ValidationError, json.JSONDecodeError) as exc:
        raise KernelIntegrityError(f"{target} has no valid manifest: {exc}") from exc
    library = target / manifest.library
    # torch names a rebuild in the same process `<module>_v<n>`; nothing else is a build of ours
    own_name = re.fullmatch(re.escape(spec.module) + r"(_v[0-9]+)?\.so", manifest.library)
    if manifest.module != spec.module or own_name is None:
        raise KernelIntegrityError(f"{target}'s manifest names another build")
    if not library.is_file() or library.is_symlink():
        raise KernelIntegrityError(f"{library} is missing or not a plain file")
    found = sha256_file(library)
    if found != manifest.sha256:
        raise KernelIntegrityError(
            f"{library} has sha256 {found[:16]}…, its build recorded {manifest.sha256[:16]}…"
        )
    return library


def _holds_a_verified_build(spec: ExtensionSpec) -> bool:
    try:
        return verified_library(spec) is not None
    except KernelIntegrityError:
        return False


def _import(module: str, library: Path) -> ModuleType:
    found = importlib.util.spec_from_file_location(module, library)
    if found is None or found.loader is None:
        raise RuntimeError(f"cannot import {library}")
    loaded = importlib.util.module_from_spec(found)
    found.loader.exec_module(loaded)
    return loaded


def load(spec: ExtensionSpec) -> ModuleType:
    """The extension of `spec`: the cached build once its hash is verified, else a fresh build
    (a cached library that fails verification is refused, logged and replaced, never opened)."""
    with _lock:
        try:
            library = verified_library(spec)
        except KernelIntegrityError as exc:
            log.error("refusing the cached %s kernel, building it afresh: %s", spec.name, exc)
            library = None
        if library is not None:
            return _import(library.stem, library)
        return build(spec)
