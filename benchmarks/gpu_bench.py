"""What the GPU benchmarks share: device clocks that leave host launch time out, the HBM peak a
roofline fraction divides by, compile caches kept in the repo tree, and the provenance every
result carries.

The GPU box is lent rarely and briefly, so its numbers must be the right ones the first time:
a kernel timed with events around one eager call measures the launch, not the kernel (the
H200 run of beeda60 read 30 µs for a 4096² matmul at T=32), and a bandwidth fraction
over the wrong peak is meaningless. Everything here also runs on a CPU, so the dry runs in the
CPU test suite go through the same code.
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parents[1]
# `build/` is gitignored and the device machine keeps ignored build outputs between calls, so
# a rerun on the same lease skips Triton's JIT and autotuning.
CACHE_DIR = ROOT / "build" / "gpu_cache"
# HBM bandwidth from the vendors' datasheets, matched on torch.cuda.get_device_name(). H100 PCIe
# (2.0 TB/s) and NVL (3.9 TB/s) share the "H100" in their names, so they are excluded by name
# and fall through to the measured copy like any other card.
HBM_TABLE: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("H200", (), 4.8e12),
    ("H100", ("PCIe", "NVL"), 3.35e12),  # SXM: "NVIDIA H100 80GB HBM3"
)


class HbmPeak(BaseModel):
    """The bandwidth a roofline fraction divides by, and where it came from."""

    model_config = ConfigDict(frozen=True)

    bytes_per_s: float | None
    source: Literal["datasheet", "measured-copy", "argument", "none"]
    measured_copy_bytes_per_s: float | None = None  # always measured on CUDA: a sanity check


class Provenance(BaseModel):
    """Which device, software and commit produced a result file."""

    model_config = ConfigDict(frozen=True)

    device: str
    device_name: str
    torch: str
    triton: str | None
    cuda: str | None
    git_commit: str | None


def use_repo_caches() -> dict[str, str]:
    """Point Triton's and Inductor's caches under build/gpu_cache (unless already set), so a
    second run on the same machine reuses compiled kernels and autotune choices."""
    dirs = {
        "TRITON_CACHE_DIR": str(CACHE_DIR / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE_DIR / "inductor"),
    }
    for key, value in dirs.items():
        os.environ.setdefault(key, value)
        Path(os.environ[key]).mkdir(parents=True, exist_ok=True)
    return {key: os.environ[key] for key in dirs}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or "cpu"


def git_commit() -> str | None:
    """MOLORA_GIT_COMMIT when set (the device machine gets the tree without .git), else HEAD
    (with `-dirty` when tracked files differ), else None."""
    if os.environ.get("MOLORA_GIT_COMMIT"):
        return os.environ["MOLORA_GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD"], cwd=ROOT, capture_output=True, timeout=30
        )
        return head.stdout.strip() + ("-dirty" if dirty.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(device: torch.device) -> Provenance:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return Provenance(
        device=str(device),
        device_name=device_name(device),
        torch=torch.__version__,
        triton=triton,
        cuda=torch.version.cuda,
        git_commit=git_commit(),
    )


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write bytes / s): the peak for a card the table
    does not name, and a check on the table for one it does."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    clock = DeviceClock(device)
    times = []
    for _ in range(reps):
        begin = clock.mark()
        dst.copy_(src)
        times.append(clock.seconds(begin, clock.mark()))
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def hbm_peak(device: torch.device, override: float | None = None) -> HbmPeak:
    """The datasheet HBM bandwidth of the card, else its measured copy bandwidth; `override`
    (bytes/s, the `--peak-bw` argument) wins. On a CPU: none unless overridden."""
    if device.type != "cuda":
        return HbmPeak(bytes_per_s=override, source="argument" if override else "none")
    measured = copy_bandwidth(device)
    if override:
        return HbmPeak(bytes_per_s=override, source="argument", measured_copy_bytes_per_s=measured)
    name = torch.cuda.get_device_name(device)
    for key, excluded, peak in HBM_TABLE:
        if key in name and not any(word in name for word in excluded):
            return HbmPeak(bytes_per_s=peak, source="datasheet", measured_copy_bytes_per_s=measured)
    return HbmPeak(bytes_per_s=measured, source="measured-copy", measured_copy_bytes_per_s=measured)


class DeviceClock:
    """Timestamps on the device's stream (CUDA events) or the host clock (CPU).

    On CUDA, `seconds(a, b)` is the device time between the two marks: what the stream spent,
    idle gaps included, never how long the host took to enqueue the work.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> torch.cuda.Event | float:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, begin: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        if isinstance(begin, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        assert isinstance(begin, float) and isinstance(end, float)
        return end - begin


def gpu_busy(device: torch.device, seconds: float = 2e-4) -> None:
    """Keep the stream busy for about `seconds` before a timed graph replay, so the host's
    submission of the replay overlaps the wait instead of showing up as a gap between events."""
    if device.type == "cuda":
        torch.cuda._sleep(int(seconds * 2e9))  # cycles at ~2 GHz; only the order matters
