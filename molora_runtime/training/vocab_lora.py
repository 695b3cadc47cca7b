"""Train an adapter the way a vocab route serves it: image-range positions run another, frozen LoRA.

Why: under the `digits` route the prompt's image tokens (BOI + codes) are served by `draw`, so
`read` attends to keys and values that `draw` computed. Trained alone, `read` only ever saw its
own there: read@v3 read 65% of eval digits alone but 17.5% through the route. Here each LoRA
linear adds the frozen image adapter's delta at image positions and the trained one elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from molora_runtime.multimodal.tokens import IMAGE_RANGE

IMAGE_ADAPTER = "image_positions"


class PositionRoute:
    """Holds the current batch's image-position mask ([B, T, 1] bool) for the patched layers."""

    def __init__(self) -> None:
        self.image: torch.Tensor | None = None

    def set(self, input_ids: torch.Tensor) -> None:
        lo, hi = IMAGE_RANGE
        self.image = ((input_ids >= lo) & (input_ids < hi)).unsqueeze(-1)


def attach_image_adapter(model, folder: Path, trained: str = "default") -> PositionRoute:
    """Load `folder` as a frozen adapter and route every LoRA linear by the position mask."""
    from peft.tuners.lora import Linear as LoraLinear

    model.load_adapter(str(folder), adapter_name=IMAGE_ADAPTER, is_trainable=False)
    for name, p in model.named_parameters():
        if f".{IMAGE_ADAPTER}." in name:
            p.requires_grad_(False)
    route = PositionRoute()
    patched = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and IMAGE_ADAPTER in module.lora_A:
            if trained not in module.lora_A:
                raise ValueError(f"image adapter adapts a layer the trained one does not: {module}")
            module.forward = _routed_forward(module, route, trained)
            patched += 1
    if not patched:
        raise ValueError(f"{folder.name}: no LoRA layer in common with the trained adapter")
    return route


def _routed_forward(module, route: PositionRoute, trained: str):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = module.base_layer(x, *args, **kwargs)
        deltas = []
        for name in (trained, IMAGE_ADAPTER):
            a, b = module.lora_A[name], module.lora_B[name]
            deltas.append(b(a(x.to(a.weight.dtype))) * module.scaling[name])
        if route.image is None:
            return result + deltas[0].to(result.dtype)
        return result + torch.where(route.image, deltas[1], deltas[0]).to(result.dtype)

    return forward
