"""Draft-free speculative decoding: where draft tokens come from, how many, and what was accepted.

A decode that finds the end of its own history earlier in that history (the prompt it copies
from, or a phrase it already wrote) proposes the tokens that followed there; the step verifies
them in one forward under the request's own route, and the output processor keeps the longest
prefix the target agrees with. `ngram` is vLLM's prompt lookup (the longest n in
[prompt_lookup_min, prompt_lookup_max] whose latest earlier occurrence has a continuation);
`suffix` also looks in the recent answers of the same tenant and route, so an adapter that
keeps giving similar answers drafts from them, and takes the longer of the two matches.
Drafts never change outputs (verification is exact), only how many steps they take; a tenant's
answers only ever draft for that tenant, so acceptance timing tells nothing across tenants.
"""
