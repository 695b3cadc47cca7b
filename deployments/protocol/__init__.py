"""What the router and the model replicas both speak: the ground floor, importing neither.

The replica's stream items (`wire`), the error table and error items (`errors`), logprob items
with token texts (`logprob_items`) and the OpenAI error body (`openai_error`). Nothing here
imports another folder of `deployments` (docs/architecture.md).
"""
