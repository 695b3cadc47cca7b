"""A pull of `shared@1` in a process of its own, for the many-pullers test of the cache.

Its own module, importing only `adapter_store`: a spawned process imports the module its target
is defined in, and the test module's imports (torch, transformers) cost each puller seconds of CPU.
"""

from __future__ import annotations

import multiprocessing as mp

from adapter_store import AdapterStoreSource


def pull_in_process(url: str, cache_dir: str, out: mp.Queue) -> None:
    source = AdapterStoreSource(url, cache_dir=cache_dir, cache_bytes=1 << 30, direct_local=False)
    path = source.adapter_path("shared@1")
    out.put(str(path))
