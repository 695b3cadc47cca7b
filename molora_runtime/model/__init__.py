"""molora_runtime.model."""
