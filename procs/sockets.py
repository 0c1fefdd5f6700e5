"""Every socket of a deployment is built here, so linger, bind/connect and limits are set once.

Each internal PULL is bound by its owner and every PUSH connects to it. The helpers take
a plain or an asyncio context (zmq.asyncio sockets come from zmq.asyncio.Context).
"""

from __future__ import annotations

import logging
import os

import msgspec
import zmq

from sarazmq.config import CurveKeys
from sarazmq.protocol.client import MAX_CLIENT_FRAME_BYTES

log = logging.getLogger("sarazmq.sockets")

# a PUSH keeps unsent frames this long at close: the peer may still be connecting
PUSH_LINGER_MS = 1000


def push_socket(ctx: zmq.Context, endpoint: str, send_timeout_ms: int | None = None) -> zmq.Socket:
    """A PUSH connected to `endpoint`; send_timeout_ms: fail a blocked send after that."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, PUSH_LINGER_MS)
    if send_timeout_ms is not None:
        sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    sock.connect(endpoint)
    return sock


def pull_socket(ctx: zmq.Context, endpoint: str, private: bool = False) -> zmq.Socket:
    """A PULL bound to `endpoint`; private: make its ipc file owner-only (0600)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    if private and endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)
    return sock


def public_router(
    ctx: zmq.Context, endpoint: str, curve: CurveKeys | None, max_backlog: int
) -> zmq.Socket:
    """The public ROUTER: size-capped frames, routed sends that fail instead of block.

    max_backlog: messages queued for one client before sends to it fail (zmq.Again).
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # libzmq drops the connection of a peer whose frame is bigger, before Python sees it
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_FRAME_BYTES)
    # a send to an unknown/disconnected peer, or one whose queue is full, raises instead
    # of being dropped silently (a silently dropped final delta would hang that client)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, max_backlog)
    if curve is not None:
        sock.curve_server = True
        sock.curve_publickey = curve.public.encode()
        sock.curve_secretkey = curve.secret.encode()
    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        # already 0600 (the process umask is 077); say so explicitly for a given path
        os.chmod(endpoint[len("ipc://") :], 0o600)
    return sock


# the node link carries plans (a new request's prompt travels once), results and control
MAX_LINK_FRAME_BYTES = 256 * 1024 * 1024


def link_router(ctx: zmq.Context, endpoint: str, curve: CurveKeys | None) -> zmq.Socket:
    """The head's end of the node link: a ROUTER whose sends to a node that is gone or
    not reading fail (EHOSTUNREACH / EAGAIN) instead of being dropped or blocking.

    With `curve`, a CurveZMQ server; the caller must run a ZAP authenticator on `ctx`
    that admits only the deployment's own public key (`NodeKeyCheck`)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_LINK_FRAME_BYTES)
    if curve is not None:
        sock.curve_server = True
        sock.curve_publickey = curve.public.encode()
        sock.curve_secretkey = curve.secret.encode()
    sock.bind(endpoint)
    return sock


def link_dealer(ctx: zmq.Context, endpoint: str, curve: CurveKeys | None) -> zmq.Socket:
    """A node's end of the node link: a DEALER that queues only to a connection whose
    handshake completed (a send before that raises zmq.Again instead of piling up).

    With `curve`, it presents the deployment's keypair as its own key (the head admits
    only that key, so only holders of the secret key file can join) and expects the
    head to hold it too."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_LINK_FRAME_BYTES)
    if curve is not None:
        sock.curve_serverkey = curve.public.encode()
        sock.curve_publickey = curve.public.encode()
        sock.curve_secretkey = curve.secret.encode()
    sock.connect(endpoint)
    return sock


class NodeKeyCheck:
    """ZAP credentials provider for the node link: admits a CurveZMQ client only if its
    key is the deployment's own public key."""

    def __init__(self, public: str) -> None:
        self.public = public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def send_once(ctx: zmq.Context, endpoint: str, msg: msgspec.Struct) -> bool:
    """Sends one message on a fresh PUSH socket (waiting at most a second for room);
    False if it could not be sent."""
    sock = push_socket(ctx, endpoint, send_timeout_ms=1000)
    try:
        sock.send(msgspec.msgpack.encode(msg))
        return True
    except zmq.ZMQError as e:
        log.error("could not send %s to %s: %s", type(msg).__name__, endpoint, e)
        return False
    finally:
        # linger: the connect is asynchronous, the message may still be queued here
        sock.close()
