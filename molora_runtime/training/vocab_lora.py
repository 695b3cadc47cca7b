"""Train an adapter the way a vocab route serves it: the other side's positions run a frozen LoRA.

Why: under the `digits` route the prompt's image tokens (BOI + codes) are served by `draw`, so
`read` attends to keys and values that `draw` computed. Trained alone, `read` only ever saw its
own there, and reads far worse through the route than alone. Here each LoRA
linear adds the frozen image adapter's delta at image positions and the trained one elsewhere.
The same holds the other way round for `draw` (`--text-adapter`): under the route its image codes
attend to the prompt's text as `read` computed it, so `draw` can train with `read` frozen at the
text positions (on a share of its steps; the rest alone, so `draw` still draws by itself).
"""

from __future__ import annotations

from pathlib import Path

import torch

from molora_runtime.multimodal.tokens import IMAGE_RANGE

IMAGE_ADAPTER = "image_positions"
TEXT_ADAPTER = "text_positions"


class PositionRoute:
    """Holds the current batch's image-position mask ([B, T, 1] bool) for the patched layers."""

    def __init__(self) -> None:
        self.image: torch.Tensor | None = None

    def set(self, input_ids: torch.Tensor) -> None:
        lo, hi = IMAGE_RANGE
        self.image = ((input_ids >= lo) & (input_ids < hi)).unsqueeze(-1)


def attach_image_adapter(model, folder: Path, trained: str = "default") -> PositionRoute:
    """Load `folder` as a frozen adapter serving image positions; the trained one serves text."""
    return attach_frozen_adapter(model, folder, at="image", trained=trained)


def attach_text_adapter(model, folder: Path, trained: str = "default") -> PositionRoute:
    """Load `folder` as a frozen adapter serving text positions; the trained one serves images."""
    return attach_frozen_adapter(model, folder, at="text", trained=trained)


def attach_frozen_adapter(model, folder: Path, at: str, trained: str = "default") -> PositionRoute:
    """Load `folder` as a frozen adapter for the `at` ("image" or "text") positions and route
    every LoRA linear by the position mask. With the mask unset (`route.image = None`) the
    trained adapter serves every position."""
    from peft.tuners.lora import Linear as LoraLinear  # the optional `train` extra

    if at not in ("image", "text"):
        raise ValueError(f"at is 'image' or 'text', got {at!r}")
    frozen = IMAGE_ADAPTER if at == "image" else TEXT_ADAPTER
    model.load_adapter(str(folder), adapter_name=frozen, is_trainable=False)
    for name, p in model.named_parameters():
        if f".{frozen}." in name:
            p.requires_grad_(False)
    route = PositionRoute()
    patched = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and frozen in module.lora_A:
            if trained not in module.lora_A:
                raise ValueError(f"{at} adapter adapts a layer the trained one does not: {module}")
            module.forward = _routed_forward(module, route, trained, frozen, at == "image")
            patched += 1
    if not patched:
        raise ValueError(f"{folder.name}: no LoRA layer in common with the trained adapter")
    return route


def _routed_forward(module, route: PositionRoute, trained: str, frozen: str, frozen_on_image: bool):
    def delta(name: str, x: torch.Tensor) -> torch.Tensor:
        a, b = module.lora_A[name], module.lora_B[name]
        return b(a(x.to(a.weight.dtype))) * module.scaling[name]

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = module.base_layer(x, *args, **kwargs)
        if route.image is None:
            return result + delta(trained, x).to(result.dtype)
        mine, other = delta(trained, x), delta(frozen, x)
        picked = (
            torch.where(route.image, other, mine)
            if frozen_on_image
            else torch.where(route.image, mine, other)
        )
        return result + picked.to(result.dtype)

    return forward
