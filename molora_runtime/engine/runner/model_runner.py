"""The model runner: everything one step runs on the device, and the step's forward.

It owns the paged KV cache (sized before anything else takes device memory), the hot-set (the
adapter slots and gate table every forward reads), the captured decode graphs, and each step's
inputs: from the scheduler's `StepBatch` it builds the token ids and the LoRA context once, then
replays a graph or builds the attention metadata and runs the model eagerly. Built from a loaded
model, never from the engine, so the engine reaches the device only through it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from molora_runtime.config import EngineConfig
from molora_runtime.engine.runner.cuda_graph import CudaGraphRunner
from molora_runtime.engine.runner.kv_budget import kv_num_blocks
from molora_runtime.engine.runner.step_batch import StepBatch
from molora_runtime.engine.runner.step_model import StepModel
from molora_runtime.engine.runner.step_result import StepResult
from molora_runtime.lora.hotset import HotSet
from molora_runtime.lora.routing import RouteSegment, build_lora_context
from molora_runtime.lora.source import AdapterSource
from molora_runtime.model.attention_meta import KVCache, step_attention
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.lora_context import LoRAContext

log = logging.getLogger(__name__)


class ModelRunner:
    """Runs the scheduler's batches on the device; holds the KV cache, hot-set and graphs."""

    @property
    def model(self) -> CausalLM:
        return self.step.model

    @property
    def kv(self) -> KVCache:
        return self.step.kv

    @property
    def hot_set(self) -> HotSet:
        return self.step.hot_set

    @property
    def width(self) -> int:
        return self.step.width

    @property
    def device(self) -> torch.device:
        return self.step.device

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        source: AdapterSource,
        served_names: list[str],
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`served_names`: the names requests may call the base model by (the hot-set refuses
        adapters trained on another); `max_model_len`: the positions a sequence may reach."""
        arch, bs = model.arch, config.kv_block_size
        # The KV budget may be a fraction of free memory: read it before the hot-set allocates.
        blocks = kv_num_blocks(config, arch, dtype, max_model_len, device)
        kv = KVCache(arch.num_layers, blocks, bs, arch.num_kv_heads, arch.head_dim, dtype, device)
        self.max_seq_len = min(max_model_len, blocks * bs)  # one sequence's reach
        hot_set = HotSet(
            model, config.hot_set, source, device, dtype, served_names,
            max_num_seqs=config.max_num_seqs,
        )  # fmt: skip
        self.step = StepModel(model, kv, hot_set, config.hot_set.max_adapters_per_token, device)
        # A learned draft reads each sampled row's hidden state (the eager forward keeps them).
        spec = config.speculative
        self.keep_hidden = spec is not None and spec.method == "eagle"
        self.graph_runner: CudaGraphRunner | None = None
        if config.enable_cuda_graph and device.type == "cuda" and not self.keep_hidden:
            max_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
            self.graph_runner = CudaGraphRunner(self.step, max_batch, -(-self.max_seq_len // bs))
            self.graph_runner.capture_all()

    def run(self, batch: StepBatch) -> StepResult:
        """Logits of the batch's `logit_rows`, the LoRA context its layers recorded into, and
        (for a learned draft only) those rows' hidden states after the final norm."""
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        ctx = self._lora_context(batch, ids)
        graphs = self.graph_runner
        if graphs is not None and batch.decode_only and graphs.can_run(batch.num_decode, ctx):
            return StepResult(batch, graphs.run(batch, ids, ctx), ctx)
        dev, kv = self.device, self.kv
        meta = step_attention(
            batch.slots, batch.positions, batch.decode_tables, batch.prefills, kv, dev
        )
        rows = torch.tensor(batch.logit_rows, dtype=torch.long, device=dev)
        with torch.inference_mode():
            if not self.keep_hidden:
                return StepResult(batch, self.model(ids, meta, kv, ctx, rows), ctx)
            # the same ops as `CausalLM.forward`, with the selected rows kept
            hidden = self.model.hidden_states(ids, meta, kv, ctx).index_select(0, rows)
            return StepResult(batch, self.model.logits(hidden), ctx, hidden=hidden)

    def _lora_context(self, batch: StepBatch, ids: torch.Tensor) -> LoRAContext | None:
        """Each token's route as slot ids and weights (None when every sequence is on the base
        model); layer tables are recorded when a sequence wants attribution or a gate's."""
        if all(seq.route.is_base for seq, _, _ in batch.segments):
            return None
        segments = [
            RouteSegment(seq.route, ids[start : start + n]) for seq, start, n in batch.segments
        ]
        record = any(
            seq.request.return_attribution or seq.route.is_learned for seq, _, _ in batch.segments
        )
        return build_lora_context(
            segments, self.hot_set, self.width, self.device, record_layers=record
        )

    def run_isolated(self, batch: StepBatch) -> Iterator[StepResult]:
        """`run(batch)`; when the forward raises, the batch is bisected and re-run until the
        culprit runs alone, and only its result carries the error.

        One sequence's data must never fail its batch-mates. Each result is postprocessed before
        the next sub-batch runs (a generator), and a re-run rewrites the same KV positions, so
        the others finish the step as if nothing happened; k culprits cost O(k log n) forwards.
        """
        try:
            result = self.run(batch)
        except Exception as exc:
            result = StepResult(batch, error=exc)
        if result.error is None:
            yield result
        elif len(batch.segments) <= 1:
            log.warning("a sequence failed its step alone: %r", result.error)
            yield result
        else:
            log.warning(
                "batched step failed (%r); re-running in halves to isolate it", result.error
            )
            for part in batch.halves():
                yield from self.run_isolated(part)
