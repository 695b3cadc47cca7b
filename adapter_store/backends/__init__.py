"""Object backends: a flat key space over a local directory or an S3-compatible bucket."""

from adapter_store.backends.base import Backend, ObjectExistsError, ObjectMissingError, Progress

__all__ = ["Backend", "ObjectExistsError", "ObjectMissingError", "Progress"]
