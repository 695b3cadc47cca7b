"""Which CPU LoRA backend serves an engine, decided once at start by timing the candidates.

The three CPU backends (`cpu_lora`: stacked, stacked-packed, grouped) compute the same delta;
which is fastest depends on the CPU, the dtype and the slot buffers' shape, so the first engine
of each shape has `kernels.chooser` time them on its own buffers (`probe`: a fused group's or a
projection's stacked buffers), keep the table per machine kind, and log it once.
`MOLORA_CPU_LORA` (`stacked`, `stacked-packed`, `grouped`; default `auto`) forces one where it
runs. This module only says what the candidates are and how they are timed.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence

import torch

from kernels import chooser, cpu_topk_delta
from molora_runtime.model.cpu_lora import (
    CpuLoRA,
    GroupedDeltas,
    GroupedLoRA,
    PackedLoRA,
    SlotBuffers,
    StackedLoRA,
)
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.packed_linear import pack_weight

log = logging.getLogger(__name__)

LORA_ENV = "MOLORA_CPU_LORA"
KINDS = ("stacked", "stacked-packed", "grouped")
PROBE_BATCHES = (8, 32)  # tokens of the timed batches spread over every slot
PROBE_TOKENS = sum(PROBE_BATCHES) + max(PROBE_BATCHES)  # and the largest again on one slot
ROUNDS, WARM_ROUNDS = 7, 2  # timed rounds per candidate; the first ones are not counted
# the CPU LoRA delta's decision, kept per probe shape for the process
CHOOSER = chooser.Chooser(
    "CPU LoRA delta", LORA_ENV, KINDS, unit="us per probe, all its batches", size="tokens",
    logger=log,
)  # fmt: skip


def probe_key(probe: SlotBuffers) -> str:
    """What the choice depends on besides the machine: the probe's slot buffers' shape."""
    widths = ",".join(str(buf.width) for buf, _ in probe.columns)
    S, rows, d_in = probe.A.shape[1:]
    dtype = str(probe.A.dtype).removeprefix("torch.")
    return f"lora:{dtype}:slots={S}:rows={rows}:d_in={d_in}:out={widths}:base={probe.slot_base}"


def backends() -> dict[str, CpuLoRA]:
    """Every CPU backend that runs here, by name, in preference order for ties (the grouped
    kernel's calls shared: where it runs, every backend takes learned tables on it)."""
    if not cpu_topk_delta.available():
        return {"stacked": StackedLoRA(), "stacked-packed": PackedLoRA()}
    grouped = GroupedDeltas()
    return {
        "stacked": StackedLoRA(grouped),
        "stacked-packed": PackedLoRA(grouped),
        "grouped": GroupedLoRA(grouped),
    }


def choose(probe: SlotBuffers | None) -> CpuLoRA:
    """The backend an engine whose slot buffers look like `probe` serves with (the plain
    stacked one where there is nothing to probe)."""
    candidates = backends()
    if probe is None:
        return candidates["stacked"]
    if pack_weight(probe.A[0, 0]) is None:  # neither packing takes this dtype here
        del candidates["stacked-packed"]

    def measure(kinds: Sequence[str]) -> chooser.Table:
        times = time_backends([candidates[kind] for kind in kinds], probe)
        return {b.name: {PROBE_TOKENS: t} for b, t in times.items()}

    best = candidates[CHOOSER.choose(probe_key(probe), list(candidates), measure)]
    learned = "the grouped kernel" if best.grouped is not None else "the stacked path"
    log.info("LoRA backend: %s; learned top-k steps: %s", best.name, learned)
    return best


def time_backends(
    candidates: list[CpuLoRA], probe: SlotBuffers, tokens: tuple[int, ...] = PROBE_BATCHES
) -> dict[CpuLoRA, float]:
    """Median seconds of layer 0's delta, summed over batches of `tokens` tokens spread over
    every slot and one of the largest batch on one slot, candidates interleaved round by round
    so a busy neighbour slows all alike."""
    slots = probe.A.shape[1] - 1 + probe.slot_base  # slot ids 1..slots (row 0 may be the zero slot)
    d_in = probe.A.shape[-1]
    dtype = probe.A.dtype
    width = probe.width
    gen = torch.Generator().manual_seed(0)
    cases = []
    tables = [(T, torch.arange(T) % slots + 1, (1, slots)) for T in tokens]
    tables.append((max(tokens), torch.ones(max(tokens), dtype=torch.long), (1, 1)))
    for T, ids, stacked in tables:
        x = torch.randn(T, d_in, generator=gen).to(dtype)
        ctx = LoRAContext(ids.view(T, 1), torch.ones(T, 1), backend=None, stacked_slots=stacked)
        cases.append((x, ctx))
    samples: dict[CpuLoRA, list[float]] = {b: [] for b in candidates}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for backend in candidates:
                start = time.perf_counter()
                for x, ctx in cases:
                    backend.add(torch.zeros(x.shape[0], width, dtype=dtype), x, probe, 0, ctx)
                samples[backend].append(time.perf_counter() - start)
    return {b: statistics.median(s[WARM_ROUNDS:]) for b, s in samples.items()}
