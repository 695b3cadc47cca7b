"""Builds each step's inputs once (ids, positions, KV slots, block tables, LoRA context) and runs
the model eagerly or through captured decode graphs. Built from model + KV + hot-set, never from
the engine."""

from __future__ import annotations

import torch

from molora_runtime.engine.cuda_graph import CudaGraphRunner
from molora_runtime.engine.step_batch import StepBatch
from molora_runtime.engine.step_model import StepModel
from molora_runtime.lora.routing import RouteSegment, build_lora_context
from molora_runtime.model.attention_meta import step_attention
from molora_runtime.model.lora_context import LoRAContext


class ModelRunner:
    def __init__(
        self, step: StepModel, max_blocks_per_seq: int, graph_max_batch: int | None = None
    ) -> None:
        """`graph_max_batch`: capture decode graphs up to this batch (None: eager only)."""
        self.step = step
        self.model, self.kv, self.hot_set = step.model, step.kv, step.hot_set
        self.width, self.device = step.width, step.device
        self.graph_runner: CudaGraphRunner | None = None
        if graph_max_batch is not None:
            self.graph_runner = CudaGraphRunner(step, graph_max_batch, max_blocks_per_seq)
            self.graph_runner.capture_all()

    def run(self, batch: StepBatch) -> tuple[torch.Tensor, LoRAContext | None]:
        """Logits of the batch's sampled rows (then its verified rows, then its prompt-logprob
        rows) and the context."""
        dev = self.device
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=dev)
        ctx = None
        if not all(seq.route.is_base for seq, _, _ in batch.segments):
            segments = [
                RouteSegment(seq.route, ids[start : start + n]) for seq, start, n in batch.segments
            ]
            record = any(
                seq.request.return_attribution or seq.route.is_learned
                for seq, _, _ in batch.segments
            )
            ctx = build_lora_context(segments, self.hot_set, self.width, dev, record_layers=record)
        graphs = self.graph_runner
        if graphs is not None and batch.decode_only and graphs.can_run(batch.num_decode, ctx):
            return graphs.run(batch, ids, ctx), ctx
        meta = step_attention(
            batch.slots, batch.positions, batch.decode_tables, batch.prefills, self.kv, dev
        )
        # Verified draft rows, then prompt positions asking for logprobs, ride after the sampled rows.
        rows = batch.logits_index + batch.verify_index + batch.prompt_logits_index
        logits_index = torch.tensor(rows, dtype=torch.long, device=dev)
        with torch.inference_mode():
            logits = self.model(ids, meta, self.kv, ctx, logits_index)
        return logits, ctx
