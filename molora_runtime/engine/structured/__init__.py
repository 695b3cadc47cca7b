"""Structured output: a JSON grammar (xgrammar) as a per-sequence token mask before sampling.

Each sequence with a `response_format` owns a `GrammarState` (an xgrammar matcher over the
compiled grammar, which is shared and cached by schema): before each sampling step it yields the
boolean mask of the tokens the grammar allows next (EOS only once the JSON is complete), and every
accepted token advances it; the sequence finishes with "stop" when the grammar terminates. The
mask is applied in `logits_processing` like any other, so it works with every route kind, n > 1,
penalties and logprobs. xgrammar is imported lazily: only requests that ask need it.

Compiling is bounded three ways: a schema's size (checked before queueing), a time budget per
compile (over it the request is a 400 and the schema is refused at once from then on), and a
fair queue (`grammar_queue`), so one tenant's costly schemas never delay another's.

The same path forces tool calls (`tool_choice` "required" or a named function): their grammar is
a structural tag built in `tool_grammar`.
"""
