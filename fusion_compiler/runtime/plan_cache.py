"""On-disk cache of serialized cuDNN execution plans.

An entry is keyed by the region's cuDNN graph recipe (ops, shapes, strides, dtypes, with tensors
named by position: the region spec, :func:`fusion_compiler.backends.cudnn.recipe.recipe_key`),
the GPU's name and SM, and the cuDNN backend and frontend versions -- a serialized plan is only
valid for the same GPU model and versions (cuDNN frontend docs, "Serialization"; docs/cudnn.md,
"Serialization"). Each file holds a one-line JSON header with those fields followed by
the plan bytes. A corrupt, stale or foreign entry is reported with a warning by the caller and
rebuilt; the cache never raises on a bad file. Small JSON records about a plan (its timing against
PyTorch's ops) sit beside it in ``<key>.<name>.json`` (:meth:`PlanCache.load_record`).

Location: the ``cache_dir`` option, else ``$FUSION_COMPILER_CACHE_DIR``, else the user cache
directory from ``platformdirs`` (``~/.cache/fusion_compiler/plans`` on Linux).
``FUSION_COMPILER_CACHE_DIR=off`` (or ``cache_dir=False``) disables the disk; the cache then keeps
what was stored in this process in memory, so identical graphs still build once per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator

import filelock
import platformdirs

__all__ = ["PlanCache", "default_cache_dir", "StaleEntry"]

log = logging.getLogger("fusion_compiler")
ENV_VAR = "FUSION_COMPILER_CACHE_DIR"
_FORMAT = 2  # 2: keyed by the canonical recipe, not the frontend's graph JSON


class StaleEntry(Exception):
    """A cache file exists for a key but its header does not match (stale, foreign or corrupt)."""


def default_cache_dir(cache_dir: str | os.PathLike | bool | None = None) -> Path | None:
    """Resolve the cache directory (see module doc); ``None`` when caching is off."""
    if cache_dir is False:
        return None
    if cache_dir not in (None, True):
        return Path(cache_dir)
    env = os.environ.get(ENV_VAR)
    if env:
        return None if env.lower() in ("off", "0", "none", "false") else Path(env)
    return Path(platformdirs.user_cache_dir("fusion_compiler")) / "plans"


class PlanCache:
    """Serialized plans on disk under ``directory``; ``None``: in this process's memory only."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self._memory: dict[str, bytes] = {}  # without a directory: key -> plan bytes
        self._records: dict[tuple[str, str], dict] = {}  # likewise (key, name) -> record

    @staticmethod
    def header(graph_json: str, device: dict) -> dict:
        """The fields an entry must match: ``device`` holds GPU name, SM, cuDNN and frontend
        versions."""
        return {"format": _FORMAT, "graph_sha256": hashlib.sha256(graph_json.encode()).hexdigest(),
                **device}

    @staticmethod
    def key(header: dict) -> str:
        return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:32]

    def path(self, header: dict) -> Path | None:
        return None if self.directory is None else self.directory / f"{self.key(header)}.plan"

    @contextlib.contextmanager
    def lock(self, header: dict, what: str = "compile") -> Iterator[None]:
        """Hold an exclusive lock on ``header``'s entry across processes (a ``filelock`` on
        ``<key>.lock`` in the directory; nothing without one). Used around a specialization's
        compile, so that processes sharing the cache directory (the ranks of a
        DistributedDataParallel job) compile one at a time: the first builds and tunes, the
        others wait, then find every plan and choice in the cache and take them, without timing.
        A lock held by a process that dies is released by the operating system (``flock``);
        a directory where no lock file can be made (read-only) is compiled in without one.
        """
        lock = None
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                lock = filelock.FileLock(self.directory / f"{self.key(header)}.lock")
                try:
                    lock.acquire(timeout=0)
                except filelock.Timeout:
                    log.info("waiting for another process to %s (lock %s)", what,
                             lock.lock_file)
                    lock.acquire()
            except OSError as exc:  # a read-only directory: compile without the lock
                log.info("no compile lock in %s (%s)", self.directory, exc)
                lock = None
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def has(self, header: dict) -> bool:
        """Whether a plan is stored for ``header`` (it may still turn out stale when loaded)."""
        path = self.path(header)
        return self.key(header) in self._memory or (path is not None and path.exists())

    def load(self, header: dict) -> bytes | None:
        """The plan bytes stored for ``header``; ``None`` when absent.

        Raises:
            StaleEntry: a file is there but unreadable or written for other fields.
        """
        blob = self._memory.get(self.key(header))
        if blob is not None:
            return blob
        path = self.path(header)
        if path is None or not path.exists():
            return None
        try:
            raw = path.read_bytes()
            head, _, blob = raw.partition(b"\n")
            stored = json.loads(head)
        except (OSError, ValueError) as exc:
            raise StaleEntry(f"unreadable plan cache entry {path}: {exc}") from exc
        if stored != header or not blob:
            raise StaleEntry(f"plan cache entry {path} was written for other versions/devices")
        return blob

    def store(self, header: dict, blob: bytes) -> None:
        """Write an entry atomically (temp file + rename); I/O errors are swallowed: the cache is
        an optimization, never a reason to fail."""
        if self.directory is None:
            self._memory[self.key(header)] = blob
        _write_atomic(self.path(header), json.dumps(header, sort_keys=True).encode() + b"\n" + blob)

    def _record_path(self, header: dict, name: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{self.key(header)}.{name}.json"

    def load_record(self, header: dict, name: str) -> dict | None:
        """The JSON record ``name`` stored beside the plan of ``header``; ``None`` when absent,
        unreadable or written for another header (never raises)."""
        record = self._records.get((self.key(header), name))
        if record is not None:
            return record
        path = self._record_path(header, name)
        try:
            stored = json.loads(path.read_text()) if path is not None and path.exists() else None
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("header") != header:
            return None
        return stored.get("record")

    def store_record(self, header: dict, name: str, record: dict) -> None:
        """Write the JSON record ``name`` beside the plan of ``header`` (I/O errors swallowed)."""
        if self.directory is None:
            self._records[(self.key(header), name)] = record
        _write_atomic(self._record_path(header, name),
                      json.dumps({"header": header, "record": record}, sort_keys=True).encode())


def _write_atomic(path: Path | None, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and a rename, so readers never see a partial
    file; ``None`` (caching off) and I/O errors do nothing: the cache is an optimization, never a
    reason to fail."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
