"""The one exception type of the SDK."""

from __future__ import annotations

from typing import Optional

import grpc

__all__ = ["BrigadeError"]


class BrigadeError(Exception):
    """A call failed: ``code`` is the gRPC status code (``None`` for a configuration error or
    a stream that ended without its final event), ``message`` the server's explanation."""

    def __init__(self, code: Optional[grpc.StatusCode], message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}" if code is not None else message)

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> BrigadeError:
        # every RpcError grpc raises for a call is also a grpc.Call with code() and details()
        code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = (e.details() if isinstance(e, grpc.Call) else None) or str(e)
        return cls(code, details)
