"""Postprocessing: one forward's logits to each request's next tokens, text, stops and outputs,
in named steps (commit, prompt logprobs, gate statistics, draft verification, sampling), and the
ways a request ends."""
