"""The request/reply layer, now :mod:`fastlock.protocol.rpc` (this name keeps
``from fastlock import rpc`` working)."""

from .protocol.rpc import DEFAULT_MAX_FRAME_BYTES, RpcConnection, open_connection

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "RpcConnection", "open_connection"]
