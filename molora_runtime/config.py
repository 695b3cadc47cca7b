"""Pydantic configuration of the engine and its adapter hot-set.

These objects are the single source of truth: `serve_config.yaml` (through
`deployments.config.ServeConfig`), the offline `LLM` API, tests and benchmarks all build them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapter_store.peft_config import SERVABLE_MODULES
from molora_runtime.routes import RouteLimits
from molora_runtime.sizes import ByteSize

LORA_TARGET_MODULES: tuple[str, ...] = SERVABLE_MODULES  # the rulebook's list

DEFAULT_MODEL = "smollm2-135m-instruct"


class StrictModel(BaseModel):
    """Base for config models: unknown keys are errors, so typos never pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


class RankPool(StrictModel):
    """Slots of one rank bucket: adapters of rank <= `rank` sit here, zero-padded to `rank`."""

    rank: int = Field(ge=1, le=256, description="padded rank of this pool's slots")
    slots: int = Field(ge=1, le=1024, description="slots in this pool")


class HotSetConfig(StrictModel):
    """Static adapter slots kept on the device; sized once so the decode step can be captured."""

    num_slots: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(
        "auto",
        description="adapter slots (slot 0, 'no adapter', is extra), the most adapters one "
        "step serves; auto: on CPU, where the slots are host memory, two per sequence a step "
        "runs (at least 8) within slot_bytes; on CUDA 8",
    )
    slot_bytes: ByteSize = Field(
        2 * 2**30,
        ge=0,
        description="num_slots auto on CPU: the slot buffers stay within this many bytes; an "
        "integer or e.g. '2GiB'",
    )
    max_rank: int = Field(16, ge=1, le=256, description="ranks are zero-padded up to this")
    rank_pools: list[RankPool] = Field(
        default_factory=list,
        max_length=16,
        description="rank-bucketed slots, e.g. [{rank: 8, slots: 8}, {rank: 64, slots: 2}]: "
        "an adapter takes a slot of the smallest pool that fits it; empty: num_slots slots "
        "padded to max_rank. When set, num_slots is their sum and max_rank their largest rank",
    )
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGET_MODULES))
    max_adapters_per_token: int = Field(
        4, ge=1, le=16, description="width of the per-token (slot, weight) table: mix size / top-k"
    )
    max_compositions: int = Field(4, ge=0, le=64, description="learned-composition gate slots")
    max_composition_experts: int = Field(8, ge=1, le=64, description="K adapters per composition")
    pinned: list[str] = Field(
        default_factory=list, description="adapters loaded at start, never evicted"
    )
    allow_base_mismatch: bool = Field(
        False,
        description="serve adapters that declare another base model (their shapes still fit)",
    )
    host_bytes: ByteSize = Field(
        512 * 2**20,
        ge=0,
        description="bytes of parsed adapters kept in host memory (the tier between the disk "
        "cache and the slots, LRU; pinned adapters stay); an integer or e.g. '512MiB'",
    )
    fetch_workers: int = Field(
        2, ge=1, le=32, description="background fetches (store -> disk -> host) at once"
    )

    @model_validator(mode="after")
    def _pools_fit(self) -> HotSetConfig:
        if not self.rank_pools:
            return self
        ranks = [p.rank for p in self.rank_pools]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"hot_set.rank_pools repeats a rank: {ranks}")
        slots, top = sum(p.slots for p in self.rank_pools), max(ranks)
        explicit = self.model_fields_set
        if "num_slots" in explicit and self.num_slots != slots:
            raise ValueError(
                f"hot_set.num_slots={self.num_slots} but rank_pools hold {slots} slots "
                "(leave num_slots out: it is their sum)"
            )
        if "max_rank" in explicit and self.max_rank != top:
            raise ValueError(
                f"hot_set.max_rank={self.max_rank} but the largest rank pool is {top} "
                "(leave max_rank out: it is their largest rank)"
            )
        if slots > 1024:
            raise ValueError(f"hot_set.rank_pools hold {slots} slots, over 1024")
        # Sorted by rank; derived fields set without re-running this validator.
        self.__dict__["rank_pools"] = sorted(self.rank_pools, key=lambda p: p.rank)
        self.__dict__["num_slots"] = slots
        self.__dict__["max_rank"] = top
        return self

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(LORA_TARGET_MODULES))
        if unknown:
            raise ValueError(
                f"unknown target modules {unknown}; supported: {list(LORA_TARGET_MODULES)}"
            )
        if not value:
            raise ValueError("target_modules must name at least one module")
        return list(dict.fromkeys(value))


class SpeculativeConfig(StrictModel):
    """Speculative decoding (vLLM's `--speculative-config` JSON): each decode proposes up to
    `num_speculative_tokens` tokens (found in the sequence's own history, or rolled out by a
    learned draft head), and one forward verifies them under the request's route, so outputs
    stay those of plain decoding."""

    method: Literal["ngram", "suffix", "eagle"] = Field(
        "ngram",
        description="ngram: the latest earlier match of the last n tokens in prompt + output "
        "(vLLM's prompt lookup); suffix: the longest such match, so longer contexts win; eagle: "
        "a learned draft head (`model`) over the target's last hidden state",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="draft tokens per step")
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="shortest n-gram matched")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="longest n-gram matched")
    max_batch: int = Field(
        4,
        ge=0,
        le=1024,
        description="speculate only while at most this many sequences decode (above it a "
        "CPU step is compute-bound and verifying drafts would cost throughput); 0: never",
    )
    exact: bool = Field(
        True,
        description="bf16 on CPU: run every base GEMM on a kernel whose rows do not depend on the "
        "batch, so greedy outputs are byte-identical to plain decoding (fp32 always is); false "
        "keeps the fastest bf16 kernels, whose outputs already vary with batching",
    )
    model: str | None = Field(
        None,
        max_length=4096,
        description="eagle: the folder of the shared draft head (`molora train draft`: "
        "draft_head.safetensors + draft_head.json); refused for ngram and suffix",
    )
    draft_heads: dict[Annotated[str, Field(min_length=1, max_length=256)], str] = Field(
        default_factory=dict,
        max_length=1024,
        description="eagle: adapter (or composition) name -> the folder of a head tuned on its "
        "outputs; a request on that one adapter drafts with it, every other route with `model`",
    )

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: object) -> object:
        """vLLM's `disable_by_batch_size` is `max_batch` here."""
        if isinstance(data, dict) and "disable_by_batch_size" in data:
            data = dict(data)
            if "max_batch" in data:
                raise ValueError("give max_batch or disable_by_batch_size, not both")
            data["max_batch"] = data.pop("disable_by_batch_size")
        return data

    @model_validator(mode="after")
    def _lookup_order(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if self.method != "eagle":
            if self.model is not None or self.draft_heads:
                raise ValueError(
                    f"a draft model is not supported by method {self.method!r} (draft-free): "
                    "'model' and 'draft_heads' need method 'eagle'"
                )
            return self
        if self.model is None:
            raise ValueError("method 'eagle' needs 'model': the folder of a draft head")
        for key, folder in [("model", self.model), *self.draft_heads.items()]:
            where = "model" if key == "model" else f"draft_heads.{key}"
            path = Path(folder).expanduser()
            if not (path / "draft_head.safetensors").is_file():
                raise ValueError(f"{where}: {folder!r} holds no draft_head.safetensors")
            if not (path / "draft_head.json").is_file():
                raise ValueError(f"{where}: {folder!r} holds no draft_head.json")
        return self


class GrammarConfig(StrictModel):
    """How response_format grammars are compiled (off the event loop and the step thread)."""

    compile_budget_s: float = Field(
        10.0, gt=0, le=600, description="longest one schema may compile; over it: a 400"
    )
    workers: int = Field(2, ge=1, le=32, description="compile threads (one tenant uses one)")
    queue_per_tenant: int = Field(
        16, ge=1, le=4096, description="schemas one tenant may have waiting to compile"
    )


class EngineConfig(StrictModel):
    """Everything one engine (one model replica) needs to run."""

    model: str = Field(
        DEFAULT_MODEL,
        description="a prepared model alias (see `molora models prepare`) or an HF folder path",
    )
    chat_template: str | None = Field(
        None,
        max_length=256 * 1024,
        description="the chat template (vLLM's --chat-template): a shipped name ('hermes'), a "
        "Jinja file or the Jinja text; default: the model's own (the embedded default model: "
        "'hermes', its ChatML with a tool format)",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_num_seqs: int = Field(8, ge=1, le=1024, description="sequences decoded together")
    max_model_len: int = Field(2048, ge=16, le=131072, description="prompt + generated tokens")
    max_num_batched_tokens: int = Field(
        1024, ge=16, description="token budget of one step (prefill chunks + decodes)"
    )
    max_queue_len: int = Field(
        256, ge=1, description="waiting requests before new ones are refused"
    )
    adapter_wait_s: float = Field(
        2.0,
        ge=0.0,
        le=600.0,
        description="how long a request whose adapters need a slot may be passed by requests "
        "of resident adapters; then admission waits for slots to drain for it (no starvation)",
    )
    enable_cuda_graph: bool = Field(True, description="capture the decode step (CUDA only)")
    cuda_graph_max_batch: int = Field(64, ge=1, le=1024)
    kv_block_size: int = Field(
        16, ge=1, le=1024, description="tokens per paged-KV block (the prefix-cache granularity)"
    )
    kv_cache_bytes: int | None = Field(
        None,
        ge=1,
        description="KV budget in bytes (K and V of every layer); default: room for "
        "max_num_seqs x max_model_len tokens",
    )
    kv_cache_fraction: float | None = Field(
        None,
        gt=0.0,
        le=0.95,
        description="KV budget as a fraction of the device's free memory (CUDA) or of host RAM",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse KV blocks of prompts that share a prefix and a route identity"
    )
    hot_set: HotSetConfig = Field(default_factory=HotSetConfig)
    routes: RouteLimits = Field(
        default_factory=RouteLimits, description="bounds on request routes (mix weights)"
    )
    tenant_weights: dict[Annotated[str, Field(min_length=1, max_length=256)], float] = Field(
        default_factory=dict,
        max_length=10_000,
        description="fair-share weight per tenant (others weigh 1): each active tenant gets "
        "weight / sum of active weights of max_num_seqs and of the KV blocks",
    )
    grammar: GrammarConfig = Field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig | None = Field(
        None, description="speculative decoding (vLLM's --speculative-config); None: off"
    )
    seed: int = 0

    @model_validator(mode="after")
    def _budget_fits(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs so every running sequence can decode"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_fraction is not None:
            raise ValueError("give kv_cache_bytes or kv_cache_fraction, not both")
        bad = [t for t, w in self.tenant_weights.items() if not 1e-3 <= w <= 1e3]
        if bad:  # also refuses NaN and Inf
            raise ValueError(f"tenant_weights must lie in [0.001, 1000]; check {bad[:5]}")
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        return self
