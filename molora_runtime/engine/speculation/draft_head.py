"""The learned draft (EAGLE-1 style): one decoder layer that reads the target model's last hidden
state and the next token, and predicts the next hidden state, which the target's own final norm
and LM head turn into a draft token.

Features are the target's hidden states after its final norm (what its LM head reads; the runner
has them for every row it keeps logits for). A step of the head: `fc(concat(feature_t,
embed(token_{t+1})))` -> the decoder layer -> the target's final norm = predicted feature_{t+1};
its argmax under the target's LM head is the draft token. The head rolls out k tokens by feeding
its own predicted features back, recomputing its attention over the short roll-out (at most 16
rows), so it keeps no KV cache of its own. The embedding, final norm and LM head are the target's,
frozen and never stored with the head; a head file holds only `fc` and the layer (about 4M
parameters for SmolLM2-135M), as safetensors beside a JSON config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from molora_runtime.model.arch import ModelArch
from molora_runtime.model.attention_meta import DenseAttention
from molora_runtime.model.decoder import CausalLM, DecoderLayer
from molora_runtime.model.layers import RotaryEmbedding

CONFIG_FILE = "draft_head.json"
WEIGHTS_FILE = "draft_head.safetensors"
MAX_ROLLOUT = 17  # positions of one roll-out: the last token and up to 16 draft tokens


class DraftHeadError(ValueError):
    """A draft head that cannot serve this model: missing, unreadable, or of other shapes."""


class DraftHeadConfig(BaseModel):
    """What a head was built for: the target's shapes (checked against the served model) and
    what it was trained on (recorded, not checked)."""

    model_config = ConfigDict(extra="forbid")

    format: int = Field(1, ge=1, le=1)
    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    base_model: str = Field("", description="the base model the head was trained on")
    adapter: str | None = Field(None, description="the adapter whose outputs it was tuned on")
    window: int = Field(5, ge=1, le=MAX_ROLLOUT, description="roll-out length it was trained on")
    trained_sequences: int = Field(0, ge=0)
    trained_steps: int = Field(0, ge=0)

    @classmethod
    def for_arch(cls, arch: ModelArch, **values: object) -> DraftHeadConfig:
        return cls(
            hidden_size=arch.hidden_size,
            vocab_size=arch.vocab_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size,
            **values,  # type: ignore[arg-type]
        )

    def mismatch(self, arch: ModelArch) -> str | None:
        """How this head's shapes differ from `arch`'s; None when they fit."""
        want = DraftHeadConfig.for_arch(arch)
        for name in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):  # fmt: skip
            if getattr(self, name) != getattr(want, name):
                return f"{name} {getattr(self, name)} != the model's {getattr(want, name)}"
        return None


class DraftHead(nn.Module):
    """fc (2h -> h) and one decoder layer of the target's architecture; the target's embedding,
    final norm and LM head are passed in, never owned."""

    def __init__(self, arch: ModelArch, config: DraftHeadConfig) -> None:
        super().__init__()
        h = arch.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(arch, 0)
        self.rope = RotaryEmbedding(arch.head_dim, MAX_ROLLOUT, arch.rope)

    @classmethod
    def from_target(cls, target: CausalLM, config: DraftHeadConfig, seed: int = 0) -> DraftHead:
        """A new head whose layer starts as the target's last decoder layer and whose fc starts
        small and random (seeded)."""
        head = cls(target.arch, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            last = {k: v.detach().clone() for k, v in target.layers[-1].state_dict().items()}
            head.layer.load_state_dict(last)
            h = target.arch.hidden_size
            head.fc.weight.copy_(torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5)
            head.fc.bias.zero_()
        return head.to(target.embed_tokens.weight.dtype)

    def forward(
        self, features: torch.Tensor, tokens: torch.Tensor, target: CausalLM
    ) -> torch.Tensor:
        """Predicted features [B, T, h] from target features [B, T, h] and the tokens that
        followed them [B, T]; row t attends to rows <= t of its own sequence."""
        B, T, h = features.shape
        x = self.fc(torch.cat([features, target.embed_tokens(tokens)], dim=-1)).reshape(B * T, h)
        positions = torch.arange(T, device=features.device).repeat(B)
        meta = DenseAttention(B, T, positions)
        out = self.layer(x, meta, self.rope.at(positions), None, None)
        return target.norm(out).view(B, T, h)

    @torch.inference_mode()
    def roll_out(self, target: CausalLM, feature: torch.Tensor, token: int, k: int) -> list[int]:
        """k greedy draft tokens after `token`, whose target feature (the row that sampled it)
        is `feature` [h]; each step recomputes the head over the roll-out so far."""
        feats = [feature.to(self.fc.weight.dtype)]
        toks = [token]
        draft: list[int] = []
        for _ in range(min(k, MAX_ROLLOUT - 1)):
            ids = torch.tensor(toks, dtype=torch.long, device=feature.device)
            pred = self(torch.stack(feats)[None], ids[None], target)[0, -1]
            tok = int(target.logits(pred[None]).argmax(-1))
            draft.append(tok)
            feats.append(pred)
            toks.append(tok)
        return draft

    def save(self, folder: Path) -> Path:
        """`draft_head.safetensors` (fc and the layer, contiguous copies) and
        `draft_head.json` in `folder`."""
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().clone() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(self.config.model_dump_json(indent=2) + "\n")
        return folder


def read_head_config(folder: str | Path) -> DraftHeadConfig:
    """The head's JSON config; DraftHeadError naming the folder when it is missing or bad."""
    folder = Path(folder).expanduser()
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise DraftHeadError(f"draft head {str(folder)!r}: not a folder")
    if not (folder / WEIGHTS_FILE).is_file():
        raise DraftHeadError(f"draft head {str(folder)!r}: no {WEIGHTS_FILE}")
    try:
        return DraftHeadConfig.model_validate(json.loads(path.read_text()))
    except OSError as exc:
        raise DraftHeadError(
            f"draft head {str(folder)!r}: cannot read {CONFIG_FILE}: {exc}"
        ) from exc
    except (ValueError, ValidationError) as exc:
        raise DraftHeadError(f"draft head {str(folder)!r}: bad {CONFIG_FILE}: {exc}") from exc


def load_head(folder: str | Path, target: CausalLM) -> DraftHead:
    """The head in `folder`, checked against `target`'s shapes (config and every tensor) and
    cast to its dtype and device; DraftHeadError says what does not fit."""
    config = read_head_config(folder)
    bad = config.mismatch(target.arch)
    if bad is not None:
        raise DraftHeadError(f"draft head {str(folder)!r} does not fit the model: {bad}")
    try:
        tensors = load_file(str(Path(folder).expanduser() / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise DraftHeadError(
            f"draft head {str(folder)!r}: cannot read {WEIGHTS_FILE}: {exc}"
        ) from exc
    head = DraftHead(target.arch, config)
    want = head.state_dict()
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise DraftHeadError(
            f"draft head {str(folder)!r}: tensors missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(want[name].shape):
            raise DraftHeadError(
                f"draft head {str(folder)!r}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"the model needs {tuple(want[name].shape)}"
            )
    head.load_state_dict(tensors)
    weight = target.embed_tokens.weight
    return head.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
