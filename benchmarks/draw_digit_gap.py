"""Does a `draw` adapter use the asked digit? Teacher-forced loss of eval drawings, right vs wrong.

For 60 eval draws the image's loss (BOI, 16 codes, EOI; nats per image, clean prefix, the adapter
alone through PEFT) is computed under the prompt that asks for its digit and under one asking for
digit + 5 (mod 10). An adapter that ignores the prompt scores both the same (draw@v2: 23.72 vs
23.81); the gap is what the digit is worth to it. Issue 19.

    python -m benchmarks.draw_digit_gap FOLDER     # a PEFT folder, or `base`
"""

from __future__ import annotations

import sys

import torch


def main() -> None:
    from peft import PeftModel

    from molora_runtime.multimodal.digits import IGNORE, DigitTask, encode_task, tasks
    from molora_runtime.training.adapter import load_base
    from molora_runtime.training.batching import collate

    torch.set_num_threads(1)
    folder = sys.argv[1]
    base, tok = load_base("smollm2-135m-instruct", torch.device("cpu"))
    model = PeftModel.from_pretrained(base, folder) if folder != "base" else base
    model.eval()
    draws = tasks("draw", 60, "eval", 0)

    def losses(task_list: list[DigitTask]) -> torch.Tensor:
        b = collate([encode_task(tok, t, "draw") for t in task_list], 0)
        with torch.no_grad():
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        keep = b.labels != IGNORE
        ce = torch.nn.functional.cross_entropy(
            logits[keep].float(), b.labels[keep], reduction="none"
        )
        rows, i = [], 0
        for r in range(len(task_list)):
            n = int(keep[r].sum())
            rows.append(ce[i : i + n][:18])
            i += n
        return torch.stack(rows)

    right = losses(draws)
    wrong = losses(
        [DigitTask(kind="draw", digit=(t.digit + 5) % 10, pixels=t.pixels) for t in draws]
    )
    print("positions: BOI, codes 1..16, EOI")
    print(f"nats per image: right digit {right.sum(1).mean():.2f}, wrong {wrong.sum(1).mean():.2f}")
    print("right per position", [round(x, 2) for x in right.mean(0).tolist()])
    print("wrong per position", [round(x, 2) for x in wrong.mean(0).tolist()])


if __name__ == "__main__":
    main()
