"""n > 1 on a replica: one engine request per choice (the fanout maps each back to its index).

Choice i runs as request `<id>.<i>` with seed `seed + i` (mod 2**64; no seed: each draws its
own), and every choice after the first names the first as `prefill_from`, so the engine prefills
the prompt once and forks its KV row into the others (when they are admitted together). All
choices run on one replica, so they share that prefill and the adapters' hot-set slots.
"""

from __future__ import annotations

from molora_runtime.engine.types import MAX_SEED, GenerationRequest


def choice_requests(req: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of `n` choices of `req` (n == 1: `req` itself)."""
    if n == 1:
        return [req]
    first = f"{req.request_id}.0"
    out = []
    for i in range(n):
        seed = req.sampling.seed
        sampling = req.sampling.model_copy(
            update={"seed": None if seed is None else (seed + i) % (MAX_SEED + 1)}
        )
        out.append(
            req.model_copy(
                update={
                    "request_id": f"{req.request_id}.{i}",
                    "sampling": sampling,
                    "prefill_from": first if i else None,
                }
            )
        )
    return out
