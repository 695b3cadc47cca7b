"""molora_runtime.engine."""
