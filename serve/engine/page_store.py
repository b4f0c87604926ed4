"""The prefix cache's tiers below the device: host memory and, optionally, a directory on disk.

A published page that the device must give up for another sequence is not lost: its bytes (every
KV source's entries and indexer keys of that page, `PageIO.read_pages`) go to the host tier
under the page's chain hash, with the time it may still live. The copy is asynchronous: the host
tier keeps the device's gather, whose transfer has started, and turns it into numpy arrays only
when a page is read back or moved on. A hit that continues past the device's pages into the host
tier (or the disk tier) gets device pages again, written from those bytes before the step that
reads them (`PageIO.write_pages`, in device order).

The disk tier (`directory`, for restarts) receives every page when it is published, one file per
page named by its key: a SHA-256 of the payload, then the payload (the rows and the deadline the
page had then). Pages are queued with their device gather and written once the gather is done
(`flush`, each engine step; blocking when the engine runs out of work), so the host never waits
for the step that computes them. A file whose checksum does not match is a miss, and is deleted.
The host tier holds at most `host_pages` pages and drops its least recently used. The disk tier
holds at most `max_bytes` of page files (None: as many as the directory takes) and deletes its least
recently used: it learns the files already there at start, oldest modification first, and a hit
touches its file, so the order survives a restart (a write cut short leaves a `.tmp` file, deleted
at start). Each process counts only the files it knows: processes that share a directory can
together exceed the limit by what the others wrote since they started.
Keys include a fingerprint of the weights (`params_fingerprint`), so pages of other weights are
never found.
"""

from __future__ import annotations

import ast
import hashlib
import io
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("deepinfer.prefix_cache")
Rows = list[np.ndarray]  # one page's rows: one array per pool array (entries, then indexer keys)


class EvictedPages:
    """A gather of evicted pages whose device-to-host copy is under way."""

    def __init__(self, arrays: list[jax.Array]):
        self._arrays, self._host = arrays, None
        for a in arrays:
            a.copy_to_host_async()

    def ready(self) -> bool:
        return self._host is not None or all(a.is_ready() for a in self._arrays)

    def rows(self, i: int) -> Rows:
        if self._host is None:
            self._host, self._arrays = [np.asarray(a) for a in self._arrays], None
        return [a[i] for a in self._host]


class HostPageStore:
    """Host tier: key -> (rows, deadline), least recently used first; writes through to `disk`."""

    def __init__(self, capacity: int, clock: Callable[[], float], disk: DiskPageStore | None = None):
        self.capacity, self.clock, self.disk = capacity, clock, disk
        self._pages: OrderedDict[bytes, tuple[EvictedPages, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, key: bytes, batch: EvictedPages, i: int, deadline: float) -> None:
        self._pages[key] = (batch, i, deadline)
        self._pages.move_to_end(key)
        while len(self._pages) > self.capacity:
            self._pages.popitem(last=False)

    def get(self, key: bytes) -> tuple[Rows, str] | None:
        """The page's rows and the tier they came from ("host" or "disk"), None on a miss."""
        entry = self._pages.get(key)
        if entry is not None:
            batch, i, deadline = entry
            if deadline <= self.clock():
                del self._pages[key]
            else:
                self._pages.move_to_end(key)
                return batch.rows(i), "host"
        if self.disk is not None:
            rows = self.disk.get(key, self.clock())
            if rows is not None:
                return rows, "disk"
        return None

    def discard(self, key: bytes) -> None:
        """The page is on the device again: the device copy is the one that ages."""
        self._pages.pop(key, None)


class DiskPageStore:
    """Disk tier: one checksummed file per page in `directory`, at most `max_bytes` of them
    (None: no limit), least recently used deleted first."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int | None = None):
        self.directory = os.fspath(directory)
        self.max_bytes = max_bytes
        os.makedirs(self.directory, exist_ok=True)
        self._queue: list[tuple[bytes, EvictedPages, int, float]] = []
        # file name -> size, least recently used first; `bytes` is their sum
        self._files: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".page.tmp"):
                _remove(entry.path)
            elif entry.name.endswith(".page") and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime_ns, entry.name, stat.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self.bytes += size
        # the modification time this store gives the next file it writes or hits: the wall
        # clock, but always after every file before (the file system's own clock is coarser)
        self._mtime_ns = max((mtime for mtime, *_ in found), default=0)
        self.evictions = 0  # files deleted to stay within `max_bytes`
        self._evict()

    def queue(self, key: bytes, batch: EvictedPages, i: int, deadline: float) -> None:
        """Write the page once its gather is done (`flush`)."""
        self._queue.append((key, batch, i, deadline))

    def flush(self, block: bool = False) -> None:
        """Write the queued pages whose bytes are on the host (all of them with `block`)."""
        waiting = []
        for item in self._queue:
            key, batch, i, deadline = item
            if block or batch.ready():
                self.put(key, batch.rows(i), deadline)
            else:
                waiting.append(item)
        self._queue = waiting

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, self._name(key))

    def put(self, key: bytes, rows: Rows, deadline: float) -> None:
        buffer = io.BytesIO()
        # raw bytes and dtype names: numpy's format cannot name ml_dtypes' FP8 scale types
        np.savez(buffer, deadline=np.float64(deadline), dtypes=np.array([r.dtype.name for r in rows]),
                 shapes=np.array([repr(r.shape) for r in rows]),
                 **{f"r{i}": np.ascontiguousarray(r).view(np.uint8).reshape(-1) for i, r in enumerate(rows)})
        payload = buffer.getvalue()
        tmp = self.path(key) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, self.path(key))
        self._touch(key)
        self._forget(key)
        self._files[self._name(key)] = 32 + len(payload)
        self.bytes += 32 + len(payload)
        self._evict()

    def get(self, key: bytes, now: float) -> Rows | None:
        self.flush(block=any(k == key for k, *_ in self._queue))
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)  # (deleted by another process sharing the directory)
            return None
        digest, payload = data[:32], data[32:]
        if hashlib.sha256(payload).digest() != digest:
            log.warning("prefix cache: %s fails its checksum; treated as a miss and deleted", path)
            self._delete(key)
            return None
        with np.load(io.BytesIO(payload)) as z:
            if float(z["deadline"]) <= now:
                self._delete(key)
                return None
            rows = [z[f"r{i}"].view(jnp.dtype(str(name))).reshape(ast.literal_eval(str(shape)))
                    for i, (name, shape) in enumerate(zip(z["dtypes"], z["shapes"]))]
        name = self._name(key)
        if name not in self._files:  # written by another process since this one started
            self._files[name] = len(data)
            self.bytes += len(data)
        self._files.move_to_end(name)
        self._touch(key)  # most recently used, for the next process too
        return rows

    def _touch(self, key: bytes) -> None:
        self._mtime_ns = max(time.time_ns(), self._mtime_ns + 1)
        os.utime(self.path(key), ns=(self._mtime_ns, self._mtime_ns))

    def _name(self, key: bytes) -> str:
        return key.hex() + ".page"

    def _forget(self, key: bytes) -> None:
        self.bytes -= self._files.pop(self._name(key), 0)

    def _delete(self, key: bytes) -> None:
        self._forget(key)
        _remove(self.path(key))

    def _evict(self) -> None:
        """Delete the least recently used files until they fit `max_bytes`."""
        while self.max_bytes is not None and self.bytes > self.max_bytes and self._files:
            name, size = self._files.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
            _remove(os.path.join(self.directory, name))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:  # (another process sharing the directory deleted it)
        pass


def params_fingerprint(params) -> bytes:
    """A cheap fingerprint of the weights: every leaf's path, shape, dtype and first and last
    elements (pages written by other weights must not be found in the disk tier)."""
    h = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        h.update(repr((jax.tree_util.keystr(path), getattr(leaf, "shape", None), str(getattr(leaf, "dtype", "")))).encode())
        if hasattr(leaf, "reshape") and getattr(leaf, "size", 0):
            flat = leaf.reshape(-1)
            h.update(np.asarray(flat[:64]).tobytes() + np.asarray(flat[-64:]).tobytes())
    return h.digest()
