"""Scheduling and blocks: admission, the step's token budget, preemption, fair share between
tenants, the adapters a sequence holds, and the paged KV blocks with their prefix cache (keyed by
route identity); sequences and block ids, never tensors."""
