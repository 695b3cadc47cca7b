"""The model runner: what a step runs on the device (KV cache, hot-set, CUDA graphs) and the step's
inputs, built from the scheduler's `StepBatch`; it knows tensors, not requests' text or stops."""
