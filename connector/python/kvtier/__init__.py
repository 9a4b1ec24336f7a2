"""kvtier: tiered KV-cache storage for LLM serving.

The native module holds the store (embedded), the engine socket client of ``kvtierd``
(sidecar) and the paged-KV gather/scatter; engine adapters build on it.
"""

from ._native import PagedKv, Sidecar, Store, engine_key, namespace_fingerprint

__all__ = ["PagedKv", "Sidecar", "Store", "engine_key", "namespace_fingerprint"]
