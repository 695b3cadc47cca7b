"""molora_runtime.lora."""
