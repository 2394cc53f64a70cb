"""Who may do what on the cache server: the one place every request's access is
decided (``authorize``), and the key a request's key becomes.

A tenant's keys are taken inside its namespace: its segment keys in that namespace stay
what they are, any other key it names becomes an object-level key of that namespace
(``<ns>/o/<key>``), so another tenant's segments and objects are out of its reach. An
admin may also name another tenant's keys in full, to read or delete them (never to
write). Only an admin sees the whole server's stats. A commit names a manifest key of
the tenant's own namespace.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Literal

from hurray_store.errors import ProtocolError
from hurray_store.keys import ObjectKey, SegmentPart, parse_key
from hurray_store.server.tenants import Tenant
from hurray_store.transport import Err

Op = Literal["read", "write", "delete", "commit", "stats"]


@dataclass(frozen=True, slots=True)
class ServedKey:
    """A client's key as this store keeps it."""

    stored: str  # the key the tiers hold
    segment: SegmentPart | None  # set for one of this store's segment objects
    obj: ObjectKey | None = None  # set for an object-level key (a group of its own)


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    key: ServedKey | None = None  # what the request's key is on this server
    why: str = ""  # when not allowed


def authorize(tenant: Tenant, op: Op, key: str | None, namespaces: Container[str]) -> Decision:
    """Whether ``tenant`` may do ``op`` (on ``key``, a client's key; None for
    ``stats``), and the key it is on this server. ``namespaces``: the tenants'.

    ``stats`` is allowed for an admin (the whole server) and denied for the others
    (their own counts only, not an error). ``commit`` needs a manifest key of the
    tenant's own namespace. ``read``, ``write`` and ``delete`` are always allowed: the
    key is mapped into the tenant's namespace, except an admin's ``read`` or
    ``delete`` of a key naming another tenant's namespace."""
    if op == "stats":
        return Decision(tenant.admin)
    assert key is not None
    ns = tenant.namespace
    k = parse_key(key)
    if op == "commit":
        if isinstance(k, SegmentPart) and k.is_manifest and k.segment.namespace == ns:
            return Decision(True, ServedKey(key, k))
        return Decision(
            False,
            why=f"{key!r} is not a manifest key of this client's namespace ({ns!r})",
        )
    if k is not None and tenant.admin and op != "write":
        other = k.segment.namespace if isinstance(k, SegmentPart) else None
        if isinstance(k, ObjectKey):
            other = k.namespace
        if other is not None and other != ns and other in namespaces:
            if isinstance(k, SegmentPart):
                return Decision(True, ServedKey(key, k))
            return Decision(True, ServedKey(key, None, k if isinstance(k, ObjectKey) else None))
    if isinstance(k, SegmentPart) and k.segment.namespace == ns:
        return Decision(True, ServedKey(key, k))
    obj = ObjectKey(ns, key)
    return Decision(True, ServedKey(obj.stored, None, obj))


def served(tenant: Tenant, op: Op, key: str, namespaces: Container[str]) -> ServedKey:
    """``authorize``'s key for an allowed request; a denied one is an ERROR (REJECTED)
    on its stream."""
    d = authorize(tenant, op, key, namespaces)
    if not d.allowed or d.key is None:
        raise ProtocolError(Err.REJECTED, d.why or f"{op} of {key!r} is not allowed", fatal=False)
    return d.key
