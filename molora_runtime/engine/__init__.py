"""molora_runtime.engine: the serving engine, one step = schedule -> run -> postprocess.

Each folder (and each module directly here) is a floor; a module imports its own floor and the
floors below it, never one above, and no two floors import each other (tests/test_layers.py):

```text
top    async_engine.py   `AsyncEngine`: the engine on its own thread, for an event loop
 |     llm.py            `LLM`: offline batch generation
 |     engine.py         `LLMEngine`: request intake, the step, stats
 |     request_check.py  a request's checks and prompt ids before it is queued
 |     device.py         the device, dtype and tokenizer an engine runs on
 |     outputs/          postprocess: commit, prompt logprobs, verification, sampling, text,
 |                       stops, endings
 |     scheduling/       admission, budgets, preemption, fair share, adapter binding, KV blocks
 |                       and the prefix cache
 |     runner/           the model runner: KV cache, hot-set, CUDA graphs, the step's batch and
 |                       inputs
 |     route_stats/      attribution, gate statistics, telemetry and summaries
 |     sequence.py       one request's state while queued or running
 |     sampling/         logits -> tokens, logprobs, the draft rejection rule, row isolation
 |     types.py          the public request and output types
 |     speculation/      drafts: n-gram lookup, a route's recent answers, acceptance counters
bottom structured/       response formats, tool-call grammars, the grammar compile queue
```
"""
