"""Draw-only quality, fast: N sampled drawings per digit, each `draw` alone and through the route.

The judge and sampling of benchmarks.multimodal_quality (T=0.7, seeded per prompt), on the draw
prompts only, for several candidate `draw` folders against one `read` (the route's text side).
Used to pick checkpoints in issue 19 (80 prompts: --per-digit 8).

    python -m benchmarks.draw_quick --draw v2=FOLDER --draw new=FOLDER --read FOLDER
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from benchmarks.multimodal_quality import digits_llm, params_for, vocab_route
    from molora_runtime.multimodal.classifier import DigitJudge
    from molora_runtime.multimodal.digits import DigitTask, prompt_ids
    from molora_runtime.multimodal.scoring import parse_completion, score_tasks
    from molora_runtime.multimodal.tokens import PIXELS
    from molora_runtime.routes import SingleRoute

    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draw", action="append", required=True, metavar="NAME=FOLDER")
    p.add_argument("--read", required=True, help="the route's text adapter (PEFT folder)")
    p.add_argument("--per-digit", type=int, default=3)
    p.add_argument("--no-route", action="store_true")
    a = p.parse_args()
    sampling = argparse.Namespace(draw_temperature=0.7, seed=0)
    draws = dict(x.split("=", 1) for x in a.draw)
    llm = digits_llm("smollm2-135m-instruct", {**draws, "read": a.read})
    tok = llm.tokenizer
    judge = DigitJudge()
    ts = [
        DigitTask(kind="draw", digit=d, pixels=[0] * PIXELS)
        for _ in range(a.per_digit)
        for d in range(10)
    ]
    prompts = [prompt_ids(tok, t) for t in ts]
    params = [params_for(t, i, sampling) for i, t in enumerate(ts)]
    for name in draws:
        routes = {"alone": SingleRoute(adapter=name)}
        if not a.no_route:
            routes["route"] = vocab_route(draw=name, read="read")
        for label, route in routes.items():
            t0 = time.monotonic()
            out = llm.generate(prompts, sampling_params=params, routes=route)
            parsed = [parse_completion(tok, r.token_ids) for r in out]
            acc = 100 * sum(s["image"] for s in score_tasks(judge, ts, parsed)) / len(ts)
            missing = sum(x.image is None for x in parsed)
            print(
                f"{name:<10} {label:<6} draw {acc:5.1f}% of {len(ts)}  no image {missing}  "
                f"{time.monotonic() - t0:.0f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()
