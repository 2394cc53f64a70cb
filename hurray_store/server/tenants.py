"""Tenants of the cache server: who a client is, which keys it may touch, and how many
bytes it may hold.

A client is known by the token it sends in its CLIENT_HELLO, and served as that token's
tenant. What it may do to which key is decided in one place, ``access.authorize``. A
tenant reads and writes one namespace only: every key it names is taken inside
its namespace, so another tenant's segments and objects are out of its reach (it can
neither read, replace nor delete them). An admin tenant may also name other tenants'
keys in full (``<namespace>/...``) to read or delete them.

With no tenants configured the server has one: the store's own namespace, admin,
reached with ``server.token`` (or by anyone when the token is empty).

Quota: the bytes of a tenant's groups (each counted once, whichever tiers hold it, and
counted from the moment its write starts). A put past the quota first deletes the
tenant's own least recently used groups (``policy.quota_victims``, in the store's own
recency of the tenant's namespace: ``GroupLevel.least_recent``); it never touches
another tenant's. Groups that leave the server for other reasons (tier eviction, a
delete) leave the tenant's counts through the store's group-left event
(``GroupLevel.on_left``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hurray_store.config import ServerConfig
from hurray_store.keys import ObjectKey, SegmentKey
from hurray_store.store import Group
from hurray_store.store.groups import GroupLevel
from hurray_store.store.policy import quota_victims

log = logging.getLogger(__name__)
# What the server keeps per stored object besides its bytes (its entries in each tier,
# the ledger and the catalog, the disk tier's writes under way), with a margin:
# tests/test_server_hostile.py checks that a 1-byte object costs no more. A tenant's
# counts charge it, so tiny objects are not free.
STORED_OBJECT_BYTES = 16 << 10


def charge(nbytes: int, objects: int) -> int:
    """What the counts charge for ``objects`` stored objects of ``nbytes`` in all."""
    return nbytes + objects * STORED_OBJECT_BYTES


@dataclass(eq=False, slots=True)
class Tenant:
    name: str
    namespace: str
    admin: bool
    quota: int | None
    token: bytes = b""
    groups: dict[Group, int] = field(default_factory=dict)  # what each is charged
    writing: dict[Group, int] = field(default_factory=dict)  # writes under way
    used: int = 0  # bytes of ``groups`` and ``writing``
    staged: int = 0  # bytes of its puts being received or staged, not yet handed to a tier
    evicted: int = 0  # groups its quota deleted

    def stats(self) -> dict[str, object]:
        return {
            "namespace": self.namespace,
            "admin": self.admin,
            "quota_bytes": self.quota,
            "used_bytes": self.used,
            "staged_bytes": self.staged,
            "groups": len(self.groups),
            "quota_evictions": self.evicted,
        }


def namespace_of(group: Group) -> str | None:
    return group.namespace if isinstance(group, SegmentKey | ObjectKey) else None


def delete_key_of(group: Group) -> str:
    """A key whose delete removes ``group`` whole."""
    if isinstance(group, SegmentKey):
        return group.manifest
    assert isinstance(group, ObjectKey)
    return group.stored


class Tenants:
    def __init__(self, cfg: ServerConfig, namespace: str, groups: GroupLevel) -> None:
        self.store_groups = groups
        self.open = not cfg.token and not cfg.tenants  # no auth: every client is admin
        self.all: list[Tenant] = []
        if cfg.token or self.open:
            self.all.append(
                Tenant(namespace, namespace, admin=True, quota=None, token=cfg.token.encode())
            )
        for t in cfg.tenants:
            self.all.append(Tenant(t.name, t.namespace, t.admin, t.quota_bytes, t.token.encode()))
        self.by_namespace = {t.namespace: t for t in self.all}
        self.on_evict: Callable[[Tenant, int], None] = lambda tenant, n: None
        groups.on_left(self._on_group_left)

    @property
    def namespaces(self) -> list[str]:
        return list(self.by_namespace)

    def match(self, token: str) -> Tenant | None:
        """The tenant whose token this is (every token compared, in constant time each,
        so the answer's timing says nothing about which one came close)."""
        if self.open:
            return self.all[0]
        given = token.encode()
        found = None
        for t in self.all:
            if hmac.compare_digest(given, t.token) and found is None:
                found = t
        return found

    # ------------------------------------------------------------------ the counts

    def count_held(self) -> None:
        """At start: charge each tenant for the groups the store found in its namespace."""
        for g, nbytes, objects in self.store_groups.every_held():
            t = self.by_namespace.get(namespace_of(g) or "")
            if t is None:
                continue
            cost = charge(nbytes, objects)
            if t.groups.get(g, -1) < cost:
                t.used += cost - t.groups.get(g, 0)
                t.groups[g] = cost

    def _oldest_first(
        self, tenant: Tenant, but: Group | None = None
    ) -> Iterator[tuple[Group, int]]:
        """The tenant's charged groups, least recently used first (the store's order)."""
        charged = tenant.groups
        for g in self.store_groups.least_recent(tenant.namespace):
            if g in charged and g != but:
                yield g, charged[g]

    async def admit(self, tenant: Tenant, group: Group, nbytes: int) -> str:
        """Make room for a write of ``group`` (``nbytes``) under the tenant's quota,
        deleting its own least recently used groups; charge it. "" when admitted (then
        ``written`` must follow), else why not."""
        old = tenant.groups.get(group, 0)  # a group written again replaces itself
        victims: list[Group] = []
        if tenant.quota is not None:
            chosen = quota_victims(
                self._oldest_first(tenant, group),
                tenant.used - old,
                tenant.quota,
                nbytes,
                self.store_groups.is_pinned,
            )
            if chosen is None:
                return (
                    f"tenant {tenant.name}: {nbytes} bytes do not fit its quota of "
                    f"{tenant.quota} bytes ({tenant.used} held, the rest being sent)"
                )
            victims = chosen
        tenant.writing[group] = tenant.writing.get(group, 0) + nbytes
        tenant.used += nbytes
        await self._evict(tenant, victims)
        return ""

    async def stage_room(self, tenant: Tenant, nbytes: int) -> str:
        """Room for ``nbytes`` more of the tenant's puts in flight: what it stages counts
        against its quota from the first byte, beside what it holds (its own least
        recently used groups are deleted to make room). "" when there is room, else
        why not."""
        if tenant.quota is None:
            return ""
        chosen = quota_victims(
            self._oldest_first(tenant),
            tenant.used + tenant.staged,
            tenant.quota,
            nbytes,
            self.store_groups.is_pinned,
        )
        if chosen is None:
            return (
                f"tenant {tenant.name}: {nbytes} more bytes in flight do not fit its quota of "
                f"{tenant.quota} bytes ({tenant.staged} being sent, {tenant.used} held); "
                "the put is dropped"
            )
        await self._evict(tenant, chosen)
        return ""

    async def _evict(self, tenant: Tenant, victims: list[Group]) -> None:
        # Off the counts first, so a put admitted while these deletes run does not
        # count the same bytes freed twice.
        for g in victims:
            self._forget(tenant, g)
        tenant.evicted += len(victims)
        if victims:
            self.on_evict(tenant, len(victims))
        for g in victims:
            await self.store_groups.delete(delete_key_of(g), "quota")

    def written(self, tenant: Tenant, group: Group, nbytes: int) -> None:
        """The write ``admit`` charged for ended: the counts take what the tiers hold."""
        left = tenant.writing.pop(group, 0) - nbytes
        if left > 0:
            tenant.writing[group] = left
        tenant.used -= nbytes
        self._forget(tenant, group)
        nbytes, objects = self.store_groups.held_bytes(group)
        held = charge(nbytes, objects) if objects else 0
        if held:
            tenant.groups[group] = held
            tenant.used += held

    def _forget(self, tenant: Tenant, group: Group) -> None:
        tenant.used -= tenant.groups.pop(group, 0)

    def _on_group_left(self, group: Group) -> None:
        t = self.by_namespace.get(namespace_of(group) or "")
        if t is not None:
            self._forget(t, group)

    def stats(self) -> dict[str, dict[str, object]]:
        return {t.name: t.stats() for t in self.all}
