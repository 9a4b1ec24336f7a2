"""One store per process and configuration, shared by every adapter instance in the process (an
engine's scheduler and worker sides, several HiCache backends); one kvtierd connection per
client name (so a scheduler's lookups never queue behind a worker's background saves)."""

from __future__ import annotations

import threading
from typing import Any

from ._native import Sidecar, Store

_STORES: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def open_store(extra: dict, default_mode: str, client: str) -> Any:
    mode = extra.get("mode", default_mode)
    if mode == "sidecar":
        if "socket" not in extra:
            raise ValueError("kvtier: mode 'sidecar' needs 'socket' (kvtierd's engine socket)")
        key = ("sidecar", extra["socket"], client, int(extra.get("copy_threads", 0)))
    elif mode == "embedded":
        key = ("embedded", extra.get("disk_dir"), int(extra.get("host_bytes", 1 << 30)),
               int(extra.get("copy_threads", 0)))
    else:
        raise ValueError(f"kvtier: mode must be embedded or sidecar, not {mode!r}")
    with _LOCK:
        if key not in _STORES:
            if mode == "sidecar":
                _STORES[key] = Sidecar(extra["socket"], client,
                                       str(extra.get("tenant_secret", "")),
                                       copy_threads=int(extra.get("copy_threads", 0)))
            else:
                _STORES[key] = Store(
                    int(extra.get("host_bytes", 1 << 30)),
                    segment_bytes=int(extra.get("segment_bytes", 16 << 20)),
                    disk_dir=extra.get("disk_dir"),
                    disk_bytes=int(extra.get("disk_bytes", 1 << 30)),
                    admission=extra.get("admission", "always"),
                    write_through=bool(extra.get("write_through", True)),
                    copy_threads=int(extra.get("copy_threads", 0)),
                )
        return _STORES[key]
