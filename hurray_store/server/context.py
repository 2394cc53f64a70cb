"""What a request handler sees of its connection (``Session`` provides it): the server,
the channel, the connection's limits and tenant, and an ERROR on one stream. A leaf
module, so the handlers (``requests.py``) and the connection (``session.py``) depend on
it and not on each other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from hurray_store import transport as tp
from hurray_store.config import ServerConfig
from hurray_store.server.tenants import Tenant

if TYPE_CHECKING:
    from hurray_store.server.session import SessionHost


class RequestContext(Protocol):
    server: SessionHost
    ch: tp.Channel | None
    cfg: ServerConfig
    frame: int  # largest TENSOR_DATA payload to send this client
    client_max: int  # largest message it takes
    peer: str
    tenant: Tenant

    async def error(self, stream: int, code: int, message: str) -> None:
        """ERROR on one stream; the connection stays."""
        ...


class PutContext(RequestContext, Protocol):
    def track(self, coro: Any, name: str, sid: int) -> None:
        """Run ``coro`` as one of the connection's requests (errors answered on ``sid``)."""
        ...
