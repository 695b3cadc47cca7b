"""Engine decode step on the device: CUDA graphs vs eager, per routing case, against the HBM roofline.

Random weights at the widths of models users serve (SmolLM2-135M, Qwen2.5-1.5B, Llama-3-8B),
written natively on the machine that runs it (no hub, no transformers); `--layers` caps the
depth of the 8B class, whose weights take long to make and move. The engine serves `batch`
requests that all decode; per shape, batch (1/32/128), mode (captured graphs / eager) and case:

- base: no adapter;
- 4 adapters: 4 different r=16 adapters on all 7 projections, spread over the batch;
- learned top-2: a composition's per-layer gate picks 2 of the same 4 per token;
- vocab route: a token's own id picks one of the 4 (vocabulary quarters);
- 4 adapters + a load: as "4 adapters", and every step also writes an adapter into a slot.

Each case reports, over decode-only steps: `step_device_ms` (CUDA events around the whole
`engine.step()`: scheduling gaps, forward, sampling — the step as the device lives it),
`forward_device_ms` (events around the model forward alone: input upload + graph replay, or the
eager kernels), `step_wall_ms` (host clock, synchronised), tok/s, the bytes a step must move
(weights + the adapters it can read + the KV it attends over) and their share of the HBM
roofline (bytes ÷ peak bandwidth ÷ time), and the ratio to the base case's step. Host launch
time is never the figure: every device time is between CUDA events. A case that cannot finish
(out of memory, the `--max-seconds` budget) is a row with `skipped` and the reason.

    python -m benchmarks.decode_step --device cuda     # 3 shapes, b=1/32/128, <= --max-seconds
    python -m benchmarks.decode_step --device cpu --dry-run   # the same code, tiny, to a temp dir
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import save_file

from benchmarks.gpu_bench import (
    DeviceClock,
    HbmPeak,
    Provenance,
    hbm_peak,
    provenance,
    use_repo_caches,
)
from benchmarks.report import RESULTS_DIR, write_json
from molora_runtime.config import EngineConfig, HotSetConfig
from molora_runtime.engine.engine import LLMEngine
from molora_runtime.engine.llm import as_route
from molora_runtime.engine.runner.cuda_graph import CudaGraphRunner
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.lora.composition import CompositionConfig, save_composition
from molora_runtime.lora.source import DirectorySource
from molora_runtime.model.arch import arch_from_config
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.tiny import make_random_adapter

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Mode = Literal["graph", "eager"]


class ModelShape(BaseModel):
    """A decoder's widths; `full_layers` is the real model's depth when `num_layers` is cut."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    full_layers: int | None = None

    def params(self, layers: int | None = None) -> int:
        """Parameters at `layers` depth (default: this one), untied embedding and head."""
        d, hd = self.hidden_size, self.hidden_size // self.num_heads
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * d * self.intermediate_size
        return (layers or self.num_layers) * layer + 2 * self.vocab_size * d


SHAPES = {
    # SmolLM2-135M: 9 query / 3 KV heads of 64, FFN 1536.
    "smollm2": ModelShape(
        hidden_size=576,
        num_layers=30,
        vocab_size=49152,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
    ),
    # Qwen2.5-1.5B's widths (its qkv biases and tied head are immaterial to the bytes moved).
    "qwen2.5-1.5b": ModelShape(
        hidden_size=1536,
        num_layers=28,
        vocab_size=151936,
        num_heads=12,
        num_kv_heads=2,
        intermediate_size=8960,
    ),
    # Llama-3-8B's widths (GQA 32/8 heads, 14336 FFN, 128k vocab).
    "llama3-8b": ModelShape(
        hidden_size=4096,
        num_layers=32,
        vocab_size=128256,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
    ),
}
# `--layers` caps shapes above this many parameters at full depth (the 8B class).
BIG_PARAMS = 2_000_000_000
# The dry run keeps each requested shape's name but these widths: seconds on a CPU.
DRY_RUN_SHAPE = ModelShape(
    hidden_size=64, num_layers=2, vocab_size=512, num_heads=4, num_kv_heads=2, intermediate_size=128
)
CASES = ("base", "4 adapters", "learned top-2 over the 4", "vocab route", "4 adapters + a load")
NUM_SLOTS = 6  # the 4 routed adapters stay resident; loads cycle through the other 2 slots


class Settings(BaseModel):
    """The run as resolved from the command line (device-dependent defaults filled in)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    dry_run: bool
    shapes: dict[str, ModelShape]
    batches: list[int]
    steps: int
    warmup: int
    rank: int
    prompt_len: int
    max_seconds: float | None  # None: no budget
    case_seconds: float
    dtype: str


class Quantiles(BaseModel):
    p50: float
    p99: float


class StepBytes(BaseModel):
    """Bytes one decode step must move: every weight once (the embedding: the batch's rows),
    the A/B of the adapters the batch can read (an upper bound), the KV it attends over."""

    weights: int
    lora: int
    kv: float
    total: float


class CaseRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shape: str
    layers: int
    batch: int
    mode: Mode
    case: str
    skipped: str | None = None
    note: str | None = None
    steps: int = 0
    step_device_ms: Quantiles | None = None
    forward_device_ms: Quantiles | None = None
    step_wall_ms: Quantiles | None = None
    tok_s: float | None = None
    bytes_per_step: StepBytes | None = None
    hbm_frac_forward: float | None = None
    hbm_frac_step: float | None = None
    vs_base_step: float | None = None
    vs_base_forward: float | None = None


class DecodeStepResult(BaseModel):
    provenance: Provenance
    settings: Settings
    peak: HbmPeak
    graph_captured: bool
    caches: dict[str, str]
    timing: dict[str, str]
    shape_setup_s: dict[str, float]
    seconds: float
    budget_spent: bool
    rows: list[CaseRow]
    targets: dict[str, Any]


TIMING = {
    "step_device_ms": "CUDA events around engine.step() (forward, sampling and the host's "
    "scheduling gaps as the device sees them); CPU: host clock",
    "forward_device_ms": "CUDA events around the model forward alone (ModelRunner.run: input "
    "upload + graph replay, or the eager kernels)",
    "step_wall_ms": "host clock around engine.step(), synchronised before and after",
    "hbm_frac_forward": "bytes_per_step.total / peak / forward_device_ms p50",
    "hbm_frac_step": "bytes_per_step.total / peak / step_device_ms p50",
    "tok_s": "batch x measured steps / their summed step_device time",
}


@dataclass
class StepTimes:
    step_device: list[float] = field(default_factory=list)
    forward_device: list[float] = field(default_factory=list)
    step_wall: list[float] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)


class BudgetSpent(Exception):
    """The case's or the run's time budget ran out; `times` holds what was measured."""

    def __init__(self, message: str, times: StepTimes) -> None:
        super().__init__(message)
        self.times = times


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def forward_clock(engine: LLMEngine, clock: DeviceClock) -> Iterator[list[tuple[Any, Any]]]:
    """Marks around every model forward the engine runs (its ModelRunner.run), restored on
    exit. `engine.step()` looks the method up on each call, so the instance attribute wins."""
    runner = engine.runner
    real = runner.run
    spans: list[tuple[Any, Any]] = []

    def timed(batch: Any) -> Any:
        begin = clock.mark()
        out = real(batch)
        spans.append((begin, clock.mark()))
        return out

    runner.run = timed  # type: ignore[method-assign]
    try:
        yield spans
    finally:
        del runner.run


def measure(
    engine: LLMEngine,
    routes: list[Any],
    batch: int,
    steps: int,
    *,
    prompt_len: int = 16,
    warmup: int = 3,
    before_step: Callable[[], None] | None = None,
    deadline: float = math.inf,
) -> StepTimes:
    """Keep `batch` requests decoding and time `steps` decode-only steps (after `warmup`).

    Requests take `routes` round-robin and decode long enough for one round; one that finishes
    anyway is replaced. `before_step` runs inside each timed decode step (the adapter load).
    Raises BudgetSpent, with what it measured, past `deadline` (time.monotonic()).
    """
    dev = engine.device
    clock = DeviceClock(dev)
    counter = 0
    gen = torch.Generator().manual_seed(0)
    vocab = engine.arch.vocab_size

    def add() -> None:
        nonlocal counter
        engine.add_request(
            GenerationRequest(
                request_id=f"r{counter}",
                prompt_token_ids=torch.randint(
                    min(100, vocab - 1), vocab, (prompt_len,), generator=gen
                ).tolist(),
                route=as_route(routes[counter % len(routes)]),
                sampling=SamplingParams(max_tokens=warmup + steps + 2, ignore_eos=True),
            )
        )
        counter += 1

    for _ in range(batch):
        add()
    times = StepTimes()
    left = warmup
    limit = 20 * (warmup + steps) + 200  # never spin on a batch that cannot all decode
    with forward_clock(engine, clock) as spans:
        for _ in range(limit):
            if len(times.step_device) >= steps:
                break
            if time.monotonic() > deadline:
                raise BudgetSpent(f"time budget spent after {len(times.step_device)} steps", times)
            decoding = sum(1 for s in engine.running if not s.in_prefill)
            is_decode = decoding == len(engine.running) == batch and not engine.waiting
            kv_tokens = sum(s.total_len for s in engine.running)
            spans.clear()
            _sync(dev)
            t0 = time.perf_counter()
            begin = clock.mark()
            if is_decode and before_step is not None:
                before_step()
            outs = engine.step()
            end = clock.mark()
            step_device = clock.seconds(begin, end)
            _sync(dev)
            wall = time.perf_counter() - t0
            if is_decode:
                if left:
                    left -= 1
                else:
                    times.step_device.append(step_device)
                    times.forward_device.append(sum(clock.seconds(b, e) for b, e in spans))
                    times.step_wall.append(wall)
                    times.kv_tokens.append(kv_tokens)
            for _ in range(sum(1 for o in outs if o.finished)):
                add()
    _drain(engine)
    if not times.step_device:
        raise RuntimeError(f"no decode-only step with all {batch} requests in {limit} steps")
    return times


def _shape(spec: str) -> tuple[str, ModelShape, bool]:
    """`NAME` or `NAME:LAYERS` (LAYERS exact: `--layers` then leaves it alone)."""
    name, _, layers = spec.partition(":")
    if name not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    shape = SHAPES[name]
    if layers:
        shape = shape.model_copy(update={"num_layers": int(layers)})
    return name, shape, bool(layers)


def resolve_shape(
    spec: tuple[str, ModelShape, bool], layers: int | None, dry_run: bool
) -> tuple[str, ModelShape]:
    """The shape a run builds: tiny in a dry run; the 8B class cut to `--layers`."""
    name, shape, exact = spec
    full = SHAPES[name].num_layers
    if dry_run:
        return name, DRY_RUN_SHAPE.model_copy(update={"full_layers": full})
    if not exact and layers and shape.params(full) > BIG_PARAMS:
        shape = shape.model_copy(update={"num_layers": min(layers, full)})
    label = name if shape.num_layers == full else f"{name}:{shape.num_layers}"
    return label, shape.model_copy(update={"full_layers": full})


def write_random_model(
    folder: Path, shape: ModelShape, device: torch.device, dtype: torch.dtype
) -> Path:
    """A native checkpoint of `shape` with random weights, made on `device` in the serving
    dtype (an 8B-wide layer stack in fp32 on the host would cost the device run a minute).
    Weights ~ N(0, 1/fan_in), norms 1, so activations stay finite at any width."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    with torch.device("meta"):
        model = CausalLM(arch_from_config(config))
    gen = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, param in model.named_parameters():
        key = name if name == "lm_head.weight" else "model." + name
        if param.dim() > 1:
            t = torch.randn(param.shape, generator=gen, device=device, dtype=dtype)
            t.mul_(param.shape[1] ** -0.5)
        else:
            t = torch.ones(param.shape, device=device, dtype=dtype)
        state[key] = t.cpu()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _engine_cases(
    tmp: Path, shape: ModelShape, rank: int, device: torch.device, dtype: torch.dtype
) -> tuple[Path, DirectorySource, dict[str, list[Any]], list[str]]:
    """The model, 8 random adapters (4 routed, 4 to load), a learned top-2 composition over
    the first 4, and each case's routes; plus the names the load case cycles through."""
    model = write_random_model(tmp / "model", shape, device, dtype)
    names = [f"ad{i}" for i in range(8)]
    adapters = {
        n: make_random_adapter(tmp / n, model, rank=rank, seed=i) for i, n in enumerate(names)
    }
    torch.manual_seed(0)
    moe = save_composition(
        tmp / "moe",
        CompositionConfig(
            base_model="model",
            adapters=names[:4],
            top_k=2,
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
        ),
        torch.randn(shape.num_layers, 4, shape.hidden_size),
    )
    quarter = shape.vocab_size // 4
    vocab = {
        "kind": "vocab",
        "ranges": [
            {
                "start": i * quarter,
                "end": shape.vocab_size if i == 3 else (i + 1) * quarter,
                "adapter": names[i],
            }
            for i in range(4)
        ],
    }
    cases: dict[str, list[Any]] = {
        "base": [None],
        "4 adapters": names[:4],
        "learned top-2 over the 4": [{"kind": "learned", "composition": "moe"}],
        "vocab route": [vocab],
        "4 adapters + a load": names[:4],
    }
    return model, DirectorySource(adapters, {"moe": moe}), cases, names[4:]


def step_bytes(engine: LLMEngine, case: str, batch: int, rank: int, kv_tokens: float) -> StepBytes:
    """What one decode step of `case` must move through HBM at least (see StepBytes)."""
    arch, model = engine.arch, engine.model
    elem = torch.finfo(engine.dtype).bits // 8
    weights = batch * arch.hidden_size * elem  # the embedding rows the batch looks up
    for name, p in model.named_parameters():
        if "embed" not in name:
            weights += p.numel() * p.element_size()
    adapter = arch.num_layers * sum(rank * sum(arch.linear_shape(m)) for m in MODULES) * elem
    per_token = {"base": 0, "learned top-2 over the 4": 2}.get(case, 1)
    adapters = min(4, batch * per_token) + (1 if case == "4 adapters + a load" else 0)
    kv = kv_tokens * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * elem
    lora = adapters * adapter
    return StepBytes(weights=weights, lora=lora, kv=kv, total=weights + lora + kv)


def _quantiles(values: list[float]) -> Quantiles:
    return Quantiles(p50=statistics.median(values) * 1e3, p99=_percentile(values, 0.99) * 1e3)


def run_case(
    engine: LLMEngine,
    settings: Settings,
    row: CaseRow,
    routes: list[Any],
    before_step: Callable[[], None] | None,
    peak: float | None,
    deadline: float,
) -> CaseRow:
    """Measure one case into `row`; out of memory, a failure or the budget make it a skipped
    row with the reason (a partial measurement of >= 3 steps is kept with a note)."""
    note = None
    case_deadline = min(deadline, time.monotonic() + settings.case_seconds)
    try:
        times = measure(
            engine,
            routes,
            row.batch,
            settings.steps,
            prompt_len=settings.prompt_len,
            warmup=settings.warmup,
            before_step=before_step,
            deadline=case_deadline,
        )
    except BudgetSpent as exc:
        _drain(engine)
        times = exc.times
        which = "--max-seconds" if case_deadline == deadline else "--case-seconds"
        if len(times.step_device) < 3:
            return row.model_copy(update={"skipped": f"{which}: {exc}"})
        note = f"{which}: {exc}"
    batch = row.batch
    bytes_ = step_bytes(engine, row.case, batch, settings.rank, statistics.mean(times.kv_tokens))
    step = _quantiles(times.step_device)
    forward = _quantiles(times.forward_device)
    return row.model_copy(
        update={
            "note": note,
            "steps": len(times.step_device),
            "step_device_ms": step,
            "forward_device_ms": forward,
            "step_wall_ms": _quantiles(times.step_wall),
            "tok_s": batch * len(times.step_device) / sum(times.step_device),
            "bytes_per_step": bytes_,
            "hbm_frac_forward": bytes_.total / peak / (forward.p50 / 1e3) if peak else None,
            "hbm_frac_step": bytes_.total / peak / (step.p50 / 1e3) if peak else None,
        }
    )


def _drain(engine: LLMEngine) -> None:
    """End every request, so the next case starts from an empty engine."""
    for s in list(engine.running) + list(engine.waiting):
        engine.abort(s.request_id)
    for _ in range(100):
        if not engine.has_work():
            return
        engine.step()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_shape(
    label: str,
    shape: ModelShape,
    settings: Settings,
    peak: float | None,
    deadline: float,
    emit: Callable[[CaseRow], None],
) -> float:
    """Every batch, mode and case of one shape on one engine (graphs captured once, for the
    measured batch sizes only); returns the setup seconds (weights, engine, capture)."""
    device = torch.device(settings.device)
    dtype = getattr(torch, settings.dtype)
    modes: list[Mode] = ["graph", "eager"]
    pending = [
        CaseRow(shape=label, layers=shape.num_layers, batch=b, mode=m, case=c)
        for b in settings.batches
        for m in modes
        for c in CASES
    ]

    def skip_rest(reason: str) -> None:
        while pending:
            emit(pending.pop(0).model_copy(update={"skipped": reason}))

    started = time.monotonic()
    # Making, writing and loading the weights dominates a big shape's setup (~5 s per GB on a
    # device box, a guess until the first run's `shape_setup_s`): skip what cannot finish.
    needed = 10 + 5 * shape.params() * torch.finfo(dtype).bits / 8e9
    if deadline - started < needed:
        skip_rest(f"--max-seconds {settings.max_seconds:g}: ~{needed:.0f} s of setup left no room")
        return 0.0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model, source, cases, spares = _engine_cases(
                Path(tmp), shape, settings.rank, device, dtype
            )
            max_batch = max(settings.batches)
            # each request's tokens, plus a block of slack: admission keeps 1% in reserve
            tokens = settings.prompt_len + settings.warmup + settings.steps + 2
            config = EngineConfig(
                model=str(model),
                device=device.type,
                dtype=settings.dtype,
                max_num_seqs=max_batch,
                max_model_len=16 * (-(-tokens // 16) + 1),
                max_num_batched_tokens=max(4096, max_batch),
                enable_cuda_graph=False,  # captured below, for the measured batch sizes only
                hot_set=HotSetConfig(
                    num_slots=NUM_SLOTS, max_rank=settings.rank, allow_base_mismatch=True
                ),
            )
            engine = LLMEngine(config, source)
            graphs = CudaGraphRunner(
                engine.runner.step,
                max_batch,
                max_blocks_per_seq=-(-engine.max_seq_len // config.kv_block_size),
                capture=device.type == "cuda",
            )
            graphs.buckets = sorted(set(settings.batches))
            graphs.capture_all()
        except Exception as exc:  # out of memory above all: the shape's rows say so
            _free(device)
            skip_rest(f"setup failed: {exc!r}"[:300])
            return time.monotonic() - started
        setup_s = time.monotonic() - started
        spare, hot_set = itertools.cycle(spares), engine.hot_set

        def load_one() -> None:
            """Write the next spare adapter into a slot (evicting the least recent)."""
            hot_set.ensure([next(spare)])

        while pending:
            row = pending.pop(0)
            if time.monotonic() > deadline:
                pending.insert(0, row)
                skip_rest(f"--max-seconds {settings.max_seconds:g} spent before this case")
                break
            engine.runner.graph_runner = graphs if row.mode == "graph" else None
            hook = load_one if row.case == "4 adapters + a load" else None
            try:
                emit(run_case(engine, settings, row, cases[row.case], hook, peak, deadline))
            except Exception as exc:  # out of memory, a failed step: say so, go on
                emit(row.model_copy(update={"skipped": f"{exc!r}"[:300]}))
                _free(device)
                try:
                    _drain(engine)
                except Exception as again:
                    skip_rest(f"engine unusable after {exc!r}: {again!r}"[:300])
        del engine, graphs
    _free(device)
    return setup_s


def _with_ratios(rows: list[CaseRow]) -> list[CaseRow]:
    """Each measured row's step and forward p50 over the base case's of the same shape,
    batch and mode."""
    base = {
        (r.shape, r.batch, r.mode): r
        for r in rows
        if r.case == "base" and r.step_device_ms and r.forward_device_ms
    }
    out = []
    for r in rows:
        b = base.get((r.shape, r.batch, r.mode))
        if b and r.step_device_ms and r.forward_device_ms:
            assert b.step_device_ms and b.forward_device_ms
            r = r.model_copy(
                update={
                    "vs_base_step": r.step_device_ms.p50 / b.step_device_ms.p50,
                    "vs_base_forward": r.forward_device_ms.p50 / b.forward_device_ms.p50,
                }
            )
        out.append(r)
    return out


def step_targets(rows: list[CaseRow]) -> dict[str, Any]:
    """Per shape and batch, graph mode: each case's step against base (4 adapters <= 1.1x is
    the target), and the best forward's share of the HBM roofline."""
    out: dict[str, Any] = {}
    for r in rows:
        if r.mode != "graph" or r.vs_base_step is None:
            continue
        key = f"{r.shape} b={r.batch}"
        if r.case == "base":
            out[f"{key}: base hbm_frac_forward"] = r.hbm_frac_forward
            continue
        out[f"{key}: {r.case} vs base"] = round(r.vs_base_step, 3)
        if r.case == "4 adapters":
            out[f"{key}: target 1.1 met"] = r.vs_base_step <= 1.1
    return out


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))


def print_header() -> None:
    print(
        f"{'shape':<16}{'b':>4} {'mode':<6}{'case':<26}{'step p50':>9}{'p99':>8}{'fwd p50':>9}"
        f"{'wall p50':>9}{'tok/s':>9}{'MB/step':>9}{'%HBM':>6}{'xbase':>7}",
        flush=True,
    )


def print_row(r: CaseRow) -> None:
    head = f"{r.shape:<16}{r.batch:>4} {r.mode:<6}{r.case:<26}"
    if r.skipped:
        print(f"{head}skipped: {r.skipped}", flush=True)
        return
    assert r.step_device_ms and r.forward_device_ms and r.step_wall_ms and r.bytes_per_step
    frac = r.hbm_frac_forward * 100 if r.hbm_frac_forward is not None else None
    print(
        f"{head}{r.step_device_ms.p50:>9.2f}{r.step_device_ms.p99:>8.2f}"
        f"{r.forward_device_ms.p50:>9.2f}{r.step_wall_ms.p50:>9.2f}{_fmt(r.tok_s, '9.0f')}"
        f"{r.bytes_per_step.total / 1e6:>9.1f}{_fmt(frac, '6.1f')}{_fmt(r.vs_base_step, '7.2f')}",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> tuple[Settings, Path, float | None]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--shape",
        type=_shape,
        action="append",
        help=f"NAME[:LAYERS], repeatable; names: {sorted(SHAPES)} (CUDA default: all three; "
        "CPU: smollm2)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=8,
        help=f"run at most this many layers of shapes over {BIG_PARAMS / 1e9:g}B parameters "
        "(0: no cap; NAME:LAYERS sets one shape exactly)",
    )
    ap.add_argument("--batch", default=None, help="batch sizes, comma-separated (CUDA: 1,32,128)")
    ap.add_argument("--steps", type=int, default=None, help="measured decode steps per case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens (CUDA 128, CPU 16)")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop cleanly after this; unmeasured cases are skipped rows (CUDA default 130)",
    )
    ap.add_argument("--case-seconds", type=float, default=30.0, help="cap on one case")
    ap.add_argument(
        "--peak-bw", type=float, default=None, help="HBM bytes/s to divide by (default: table)"
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the same code path with tiny widths, b=1,4 and 3 steps, in seconds, written to "
        "a temp dir (never benchmarks/results/)",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON (default: results dir)")
    args = ap.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    if args.dry_run and args.out and args.out.resolve().is_relative_to(RESULTS_DIR):
        ap.error("a dry run never writes under benchmarks/results/")
    budgeted = cuda and not args.dry_run
    specs = args.shape or (
        [_shape(n) for n in SHAPES] if cuda or args.dry_run else [_shape("smollm2")]
    )
    shapes = dict(resolve_shape(s, args.layers, args.dry_run) for s in specs)
    batch = args.batch or ("1,4" if args.dry_run else "1,32,128" if cuda else "32")
    steps = args.steps or (3 if args.dry_run else 20 if cuda else 50)
    settings = Settings(
        device=args.device,
        dry_run=args.dry_run,
        shapes=shapes,
        batches=[int(b) for b in batch.split(",")],
        steps=steps,
        warmup=1 if args.dry_run else args.warmup,
        rank=4 if args.dry_run else args.rank,
        prompt_len=args.prompt_len or (8 if args.dry_run else 128 if cuda else 16),
        max_seconds=args.max_seconds if args.max_seconds is not None or not budgeted else 130.0,
        case_seconds=args.case_seconds,
        dtype="bfloat16" if cuda else "float32",
    )
    name = f"decode_step_{torch.device(args.device).type}.json"
    out = args.out or RESULTS_DIR / name
    if args.dry_run and args.out is None:
        out = Path(tempfile.mkdtemp(prefix="decode_step_dry_run_")) / name
    return settings, out, args.peak_bw


def main(argv: list[str] | None = None) -> int:
    settings, out, peak_bw = parse_args(argv)
    threads = torch.get_num_threads()
    if settings.dry_run and settings.device == "cpu":
        # The dry run proves the code path, not a speed: one thread, so a box whose cores are
        # shared does not spin OpenMP barriers (4x slower on a loaded 2-core box).
        torch.set_num_threads(1)
    try:
        return run(settings, out, peak_bw)
    finally:
        torch.set_num_threads(threads)


def run(settings: Settings, out: Path, peak_bw: float | None) -> int:
    """Every shape in turn under one deadline; the JSON is rewritten after every row."""
    started = time.monotonic()
    deadline = started + (settings.max_seconds if settings.max_seconds is not None else math.inf)
    device = torch.device(settings.device)
    caches = use_repo_caches() if device.type == "cuda" else {}
    peak = hbm_peak(device, peak_bw)
    prov = provenance(device)
    print(
        f"{prov.device_name}: torch {prov.torch}, triton {prov.triton}, peak "
        f"{(peak.bytes_per_s or 0) / 1e12:.2f} TB/s ({peak.source})",
        flush=True,
    )
    rows: list[CaseRow] = []
    setup: dict[str, float] = {}

    def write(spent: bool = False, final: bool = False) -> None:
        ratios = _with_ratios(rows)
        result = DecodeStepResult(
            provenance=prov,
            settings=settings,
            peak=peak,
            graph_captured=device.type == "cuda",
            caches=caches,
            timing=TIMING,
            shape_setup_s=setup,
            seconds=time.monotonic() - started,
            budget_spent=spent,
            rows=ratios,
            targets=step_targets(ratios),
        )
        payload = result.model_dump(mode="json")
        if final:
            write_json(out, payload)
        else:  # a run cut short (timeout) keeps its rows; say where only once, at the end
            with contextlib.redirect_stdout(io.StringIO()):
                write_json(out, payload)

    def emit(row: CaseRow) -> None:
        rows.append(row)
        print_row(_with_ratios(rows)[-1])
        write()

    print_header()
    for label, shape in settings.shapes.items():
        setup[label] = run_shape(label, shape, settings, peak.bytes_per_s, deadline, emit)
    write(spent=any(r.skipped and "--max-seconds" in r.skipped for r in rows), final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
