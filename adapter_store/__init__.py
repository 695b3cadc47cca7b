"""adapter_store package."""
