"""Captured decode steps: one CUDA graph per batch-size bucket over static buffers.

Every tensor the decode step reads lives in a static buffer here (token ids, positions, KV slots,
padded block tables, context lengths, per-token slot ids and weights, learned-route composition
ids, top-k and temperature); the hot-set's slot buffers and gate table are static too, so loading
an adapter into a slot between steps needs no re-capture. Padded rows write to the KV cache's
scratch block, attend over it, and route to slot 0. On a CPU (`capture=False`) the same
static-shape step runs eagerly, which is how the tests prove it equals the dynamic path.
"""

from __future__ import annotations

import torch

from molora_runtime.engine.runner.step_batch import StepBatch
from molora_runtime.engine.runner.step_model import StepModel
from molora_runtime.model.attention_meta import CacheAttention
from molora_runtime.model.lora_context import LoRAContext


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, capped at `max_batch`."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    b = 16
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 64 else 16
    sizes.append(max_batch)
    return sorted(set(sizes))


class CudaGraphRunner:
    """The decode step at static shapes: one captured graph per batch bucket (or, without
    `capture`, the same static step run eagerly), fed from the step's batch and LoRA context."""

    def __init__(
        self, step: StepModel, max_batch: int, max_blocks_per_seq: int, capture: bool | None = None
    ) -> None:
        self.model, self.kv, self.hot_set = step.model, step.kv, step.hot_set
        self.device = dev = step.device
        self.capture = dev.type == "cuda" if capture is None else capture
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        B, W, kv = max_batch, step.width, step.kv
        # The per-token int64 inputs are rows of one device tensor, so one host→device copy
        # fills them; `_host` is its (pinned, on CUDA) staging twin, written through numpy.
        self._rows = torch.zeros(4, B, dtype=torch.long, device=dev)
        self.input_ids, self.positions, self.slot_blocks, self.slot_offsets = self._rows
        self.block_tables = torch.full(
            (B, max_blocks_per_seq), kv.scratch_block, dtype=torch.int32, device=dev
        )
        pin = dev.type == "cuda" and torch.cuda.is_available()
        self._pinned = pin
        self._host_rows = torch.zeros(4, B, dtype=torch.long, pin_memory=pin)
        self._host_tables = torch.zeros(B, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self._copied: torch.cuda.Event | None = None  # last staging upload (CUDA)
        self.context_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.slot_ids = torch.zeros(B, W, dtype=torch.long, device=dev)
        self.weights = torch.zeros(B, W, dtype=torch.float32, device=dev)
        self.comp_idx = torch.full((B,), -1, dtype=torch.long, device=dev)
        self.top_k = torch.ones(B, dtype=torch.long, device=dev)
        self.temperature = torch.ones(B, dtype=torch.float32, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._contexts: dict[int, LoRAContext] = {}
        self._pool = None

    def can_run(self, num_tokens: int, ctx: LoRAContext | None) -> bool:
        """Whether a decode-only batch of `num_tokens` rows fits a captured bucket."""
        return 0 < num_tokens <= self.max_batch

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _static_forward(self, bucket: int) -> tuple[torch.Tensor, LoRAContext]:
        ctx = LoRAContext(
            slot_ids=self.slot_ids[:bucket],
            weights=self.weights[:bucket],
            backend=self.hot_set.backend,
            stacked_slots=(1, self.hot_set.num_slots),  # static shapes: every slot
            comp_idx=self.comp_idx[:bucket],
            gates=self.hot_set.gates,
            top_k=self.top_k[:bucket],
            temperature=self.temperature[:bucket],
            record_layers=True,
        )
        meta = CacheAttention(
            slot_blocks=self.slot_blocks[:bucket],
            slot_offsets=self.slot_offsets[:bucket],
            positions=self.positions[:bucket],
            num_decode=bucket,
            block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket],
            static=True,
        )
        logits = self.model(self.input_ids[:bucket], meta, self.kv, ctx)
        return logits, ctx

    def _ensure_graph(self, bucket: int) -> None:
        if bucket in self._graphs:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up: allocator, Triton autotune, cuBLAS handles
                self._static_forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            logits, ctx = self._static_forward(bucket)
        self._pool = graph.pool()
        self._graphs[bucket], self._outputs[bucket], self._contexts[bucket] = graph, logits, ctx

    def capture_all(self) -> None:
        """Capture every bucket up front (startup), so no request pays for a capture.

        Largest bucket first, all into one memory pool: the smaller graphs then reuse the
        biggest one's blocks instead of each growing the pool.
        """
        if self.capture:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            for bucket in sorted(self.buckets, reverse=True):
                self._ensure_graph(bucket)

    def _load_inputs(self, batch: StepBatch, ids: torch.Tensor) -> None:
        """Stage the step's host lists and upload them with one non-blocking copy per tensor.

        Padded rows (n..B) read token 0 at position 0, write K/V to the scratch block and
        attend over it (context length 1).
        """
        n = batch.num_decode
        if self._copied is not None:  # the previous upload may still read the staging buffers
            self._copied.synchronize()
        rows, tables = self._host_rows.numpy(), self._host_tables.numpy()
        scratch = self.kv.scratch_block
        rows[1:, n:] = 0
        rows[2, n:] = scratch
        rows[1, :n] = batch.positions[:n]
        slots = batch.slots[:n]
        rows[2, :n] = [b for b, _ in slots]
        rows[3, :n] = [o for _, o in slots]
        tables.fill(scratch)
        for i, t in enumerate(batch.decode_tables[:n]):
            tables[i, : len(t)] = t
        self._rows[1:].copy_(self._host_rows[1:], non_blocking=self._pinned)
        self.block_tables.copy_(self._host_tables, non_blocking=self._pinned)
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.input_ids.zero_()
        self.input_ids[:n].copy_(ids[:n])
        self.context_lens.copy_(self.positions + 1)

    def run(self, batch: StepBatch, ids: torch.Tensor, ctx: LoRAContext | None) -> torch.Tensor:
        """Run a decode-only batch through the static step; returns logits [n, V]."""
        n = batch.num_decode
        bucket = self._bucket(n)
        self._load_inputs(batch, ids)
        self.slot_ids.zero_()
        self.weights.zero_()
        self.comp_idx.fill_(-1)
        self.top_k.fill_(1)
        self.temperature.fill_(1.0)
        if ctx is not None:
            self.slot_ids[:n].copy_(ctx.slot_ids[:n])
            self.weights[:n].copy_(ctx.weights[:n])
            if ctx.has_learned:
                assert ctx.top_k is not None and ctx.temperature is not None
                self.comp_idx[:n].copy_(ctx.comp_idx[:n])  # type: ignore[index]
                self.top_k[:n].copy_(ctx.top_k[:n])
                self.temperature[:n].copy_(ctx.temperature[:n])
        if self.capture:
            self._ensure_graph(bucket)
            self._graphs[bucket].replay()
            logits, static_ctx = self._outputs[bucket], self._contexts[bucket]
        else:
            with torch.inference_mode():
                logits, static_ctx = self._static_forward(bucket)
        if ctx is not None:
            ctx.layer_tables = [(s[:n], w[:n]) for s, w in static_ctx.layer_tables]
            ctx.layer_logits = [lg[:n] for lg in static_ctx.layer_logits]
        return logits[:n]
