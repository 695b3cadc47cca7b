"""Sampling: logits rows to tokens (greedy, top-k/top-p/min-p, penalties, masks, logprobs), the
rejection rule that verifies a draft, and the screen that fails a bad row alone."""
