"""The ``s3`` tier: an S3 bucket, or any S3-compatible object store (MinIO, SeaweedFS,
Ceph RGW, Cloudflare R2), through obstore (with ``s3_log.py``, the only tier modules
that import ``obstore``).

Layout: ``<prefix>/objects/<key>`` for every object, ``<prefix>/quarantine/<key>`` for
corrupt ones taken out of service, ``<prefix>/log/`` for the change log. One object is
one S3 object: a PUT is atomic (a reader sees the old object, none, or the whole new
one); an object larger than ``multipart_bytes`` goes up in parts of that size, and S3
publishes it whole when the upload completes. Partial retrieves read exactly their byte
ranges (ranged GETs, never coalesced into larger reads). At open the store lists
``objects/`` to find committed segments again (restart).

Several stores may share one prefix, as several processes share a disk folder:

* nothing another store may still be writing is swept: at open, an uncommitted object
  (a segment's layer without its manifest) is deleted only once it is older than
  ``orphan_age_s`` (its Last-Modified);
* a group's last object (a segment's manifest, the commit point) is written only after
  a HEAD of each of its other objects confirms them there and whole: one HEAD per
  layer object, in parallel;
* every commit and delete is announced in the change log (``tiers/changelog.py``: one
  empty object per change, its name saying what changed), which each store lists every
  ``change_poll_s`` (one LIST, from a minute before the newest entry it has read);
  what it reads joins or leaves its ledger and index on its next call. Entries older
  than ``change_log_keep_s`` are deleted by whichever store lists them. Until a store
  has read a change (up to ``change_poll_s``), a lookup may promise a segment another
  store just removed; its get is then a miss, and the segment leaves the ledger.

Outages are the Redis tier's rules: a connection error, a timeout, a 5xx, throttling
(408, 429) or refused credentials (401, 403) turn the call into a miss (reads) or a
skipped write (``False``), log one warning for the whole outage, and start a backoff
during which calls return at once. obstore's own retries are kept short (two, within
``timeout_s``), so a down endpoint costs one timeout, not minutes.

Faults of one object are that object's: a missing object (404), a range past its end
(416, an object shorter than its ledger says), a short read or any other 4xx answer is a
miss for that object, which the store then drops from its ledger, and says nothing
about the endpoint (it answered). Every transfer's timeout scales with its size: a
whole-object GET is timed ``timeout_s`` to its answer's head, then ``timeout_s`` plus
one second per 50 MB of the size the head gives.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import obstore
from obstore.exceptions import InvalidPathError, NotFoundError
from obstore.store import S3Store

if TYPE_CHECKING:
    from obstore.store import ClientConfig

from hurray_store.config import S3TierConfig, parse_s3_url
from hurray_store.tiers.base import Capabilities, GroupObject
from hurray_store.tiers.helpers import one_buffer, transfer_timeout_s
from hurray_store.tiers.outage import Outage, ServiceTier
from hurray_store.tiers.s3_log import S3ChangeLog
from hurray_store.tiers.types import Blob, Buffer, Range, ReadInto

log = logging.getLogger(__name__)
_PARALLEL = 12  # parts of one object in flight at once (upload and ranged download)


class S3Tier(ServiceTier):
    config_cls = S3TierConfig
    # Other stores on the prefix: read through the change log.
    caps = Capabilities(persistent=True, networked=True)

    def __init__(self, cfg: S3TierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        bucket, prefix = parse_s3_url(cfg.url)
        self.bucket = bucket
        self.root = f"{prefix}/" if prefix else ""
        self.objects = self.root + "objects/"
        self.quarantined = self.root + "quarantine/"
        opts: ClientConfig = {
            "connect_timeout": timedelta(seconds=cfg.timeout_s),
            # Whole calls are timed in guard (longer for more bytes); this is a backstop.
            "timeout": timedelta(seconds=max(300.0, cfg.timeout_s)),
            "allow_http": cfg.endpoint.startswith("http://"),
        }
        kwargs: dict[str, Any] = {}
        if cfg.endpoint:
            kwargs["endpoint"] = cfg.endpoint
            kwargs["virtual_hosted_style_request"] = False  # path style: bucket in the path
        if cfg.region:
            kwargs["region"] = cfg.region
        if cfg.access_key_id or cfg.secret_access_key:
            kwargs["access_key_id"] = cfg.access_key_id
            kwargs["secret_access_key"] = cfg.secret_access_key
        # What the config leaves empty, obstore takes the usual AWS way: AWS_REGION,
        # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, ... from the
        # environment, or an instance role.
        self.store = S3Store(
            bucket,
            client_options=opts,
            retry_config={
                "max_retries": 2,
                "retry_timeout": timedelta(seconds=cfg.timeout_s),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=50),
                    "max_backoff": timedelta(seconds=1),
                    "base": 2.0,
                },
            },
            **kwargs,
        )
        self._calls = asyncio.Semaphore(cfg.max_connections)
        self.outage = Outage(self.name, cfg.backoff_initial_s, cfg.backoff_max_s)
        # Other stores on the prefix: read through the change log.
        self.changelog = S3ChangeLog(self, self.root + "log/")

    def path(self, key: str) -> str:
        return self.objects + key

    # ------------------------------------------------------------------ outage guard

    async def _failed(self, what: str, e: Exception) -> None:
        if isinstance(e, FileNotFoundError | NotFoundError):
            self.outage.up()  # a missing object (obstore raises the former for a 404)
        elif isinstance(e, InvalidPathError):  # a key S3 cannot hold: this call fails
            log.warning("s3 tier %s: %s: %s", self.name, what, e)
        elif object_fault(e):
            # The endpoint answered about this object (a range past its end, a
            # precondition): a miss for it alone.
            log.info("s3 tier %s: %s: %s", self.name, what, _first_line(e))
            self.outage.up()
        else:  # obstore's errors, timeouts, 5xx: the endpoint is not serving
            self.outage.down(what, _first_line(e))

    # ------------------------------------------------------------------ interface

    async def open(self) -> None:
        await self.guard("open (listing the bucket)", self._first_page, False)
        self.outage.watch(self._first_page, self.cfg.timeout_s)
        self.changelog.start()

    async def _first_page(self) -> bool:
        """The bucket's first key listed: the outage's probe."""
        async for _ in obstore.list(self.store, self.objects, chunk_size=1):
            break
        return True

    async def close(self) -> None:
        self.outage.stop()
        await self.changelog.stop()

    # ------------------------------------------------------------------ other stores

    def log_changes(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        self.changelog.write(added, removed)

    def changes(self) -> list[tuple[bool, str]]:
        return self.changelog.feed.take()

    def has_changes(self) -> bool:
        return bool(self.changelog.feed.pending)

    async def poll(self) -> None:
        """List the change log for what the other stores did since the last listing."""
        await self.changelog.poll()

    async def removable_orphans(self, keys: Sequence[str]) -> list[str]:
        """Uncommitted objects older than ``orphan_age_s``: a younger one may be a layer
        another store is still uploading."""
        now = datetime.now(UTC)

        async def age(key: str) -> float | None:
            async def run() -> float:
                meta = await obstore.head_async(self.store, self.path(key))
                return (now - meta["last_modified"]).total_seconds()

            return await self.guard("HEAD", run, None)

        ages = await asyncio.gather(*(age(k) for k in keys))
        limit = self.cfg.orphan_age_s
        old = [k for k, a in zip(keys, ages, strict=True) if a is not None and a > limit]
        if len(old) < len(keys):
            log.info(
                "s3 tier %s: %d uncommitted objects kept: another store may be writing them",
                self.name,
                len(keys) - len(old),
            )
        return old

    async def confirm(self, objects: Sequence[GroupObject]) -> bool:
        """A HEAD of each: every one there with its size, or the commit is not made."""
        sizes = await self.sizes([o.key for o in objects])
        missing = [o.key for o, n in zip(objects, sizes, strict=True) if n != o.nbytes]
        if missing:
            log.warning(
                "s3 tier %s: %d objects of a group are gone before its commit (%s); not committed",
                self.name,
                len(missing),
                missing[0],
            )
        return not missing

    async def get(self, key: str) -> Blob | None:
        """The whole object, one GET (parallel ranged GETs of its parts are slower than
        one stream: each is a request of its own to the service)."""

        async def run() -> Blob:
            async with asyncio.timeout(self.cfg.timeout_s):
                r = await obstore.get_async(self.store, self.path(key))
            size = int(r.meta["size"])
            async with asyncio.timeout(transfer_timeout_s(self.cfg.timeout_s, size)):
                body = memoryview(await r.bytes_async())
            if body.nbytes != size:
                raise ShortRead(f"{key}: {body.nbytes} of {size} bytes")
            return body

        return await self.guard("GET", run, None, timed=True)

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        if not ranges:
            return [] if await self.contains(key) else None

        async def run() -> list[Any]:
            return await obstore.get_ranges_async(
                self.store,
                self.path(key),
                starts=[off for off, _ in ranges],
                lengths=[ln for _, ln in ranges],
                coalesce=0,  # exactly the bytes asked for
            )

        got = await self.guard("GET (ranges)", run, None, sum(ln for _, ln in ranges))
        if got is None:
            return None
        parts = [memoryview(b) for b in got]
        # An object shorter than a range asks comes back short: a miss.
        if any(p.nbytes != ln for p, (_, ln) in zip(parts, ranges, strict=True)):
            return None
        return list(parts)

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        big = nbytes > self.cfg.multipart_bytes
        body: Any = list(buffers) if big else one_buffer(buffers)

        async def run() -> bool:
            await obstore.put_async(
                self.store,
                self.path(key),
                body,
                use_multipart=big,
                chunk_size=self.cfg.multipart_bytes,
                max_concurrency=_PARALLEL,
            )
            return True

        return await self.guard("PUT", run, False, nbytes)

    async def delete(self, key: str) -> None:
        await self.delete_many([key])

    async def delete_many(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        async def run() -> None:
            await obstore.delete_async(self.store, [self.path(k) for k in keys])

        await self.guard("DELETE", run, None)

    async def contains(self, key: str) -> bool:
        async def run() -> bool:
            await obstore.head_async(self.store, self.path(key))
            return True

        return await self.guard("HEAD", run, False)

    async def sizes(self, keys: Sequence[str]) -> list[int | None]:
        async def one(key: str) -> int | None:
            async def run() -> int | None:
                meta = await obstore.head_async(self.store, self.path(key))
                return int(meta["size"])

            return await self.guard("HEAD", run, None)

        return list(await asyncio.gather(*(one(k) for k in keys)))

    async def quarantine(self, key: str) -> None:
        """Move a corrupt object to ``quarantine/`` (kept for a post-mortem, out of
        every scan)."""

        async def run() -> None:
            await obstore.rename_async(self.store, self.path(key), self.quarantined + key)

        await self.guard("quarantine", run, None)

    async def scan(self) -> AsyncIterator[tuple[str, int]]:
        """Every object under ``objects/`` and its size, 1000 per listing page, each
        page yielded before the next is asked for. An outage ends the scan where it is."""
        stream = obstore.list(self.store, self.objects, chunk_size=1000)
        n = len(self.objects)

        async def page() -> list[tuple[str, int]] | None:
            async for batch in stream:
                return [(m["path"][n:], int(m["size"])) for m in batch]
            return []

        while True:
            got = await self.guard("LIST", page, None)
            if not got:
                return
            for item in got:
                yield item


class ShortRead(Exception):
    """An answer shorter than the object it is of."""


# The HTTP status obstore's error text carries ("... non-2xx status code: 416 ...").
_STATUS = re.compile(r"status code: (\d{3})")
# 4xx answers that say the endpoint will not serve anyone now, not that one object is bad.
_SERVICE_4XX = frozenset({401, 403, 408, 429})


def object_fault(e: BaseException) -> bool:
    """True when ``e`` is about one object (a short read, a 4xx answer other than
    refused credentials and throttling); False for what says the endpoint is down."""
    if isinstance(e, ShortRead):
        return True
    m = _STATUS.search(str(e))
    return m is not None and 400 <= int(m.group(1)) < 500 and int(m.group(1)) not in _SERVICE_4XX


def _first_line(e: BaseException) -> BaseException:
    """obstore's errors carry a debug dump after their first line; a log needs the line."""
    text = str(e).strip().split("\n", 1)[0]
    if text == str(e):
        return e
    try:
        return type(e)(text)
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {text}")
