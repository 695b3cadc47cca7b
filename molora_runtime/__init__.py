"""molora_runtime package."""
