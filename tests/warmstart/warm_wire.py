"""The messages between the warm interpreter and its clients: a 4-byte length, then JSON; the
client's descriptors ride along the request as SCM_RIGHTS."""

from __future__ import annotations

import array
import json
import os
import socket
import struct

MAX_FDS = 250  # SCM_RIGHTS carries at most 253 descriptors a message


def send_msg(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    payload = struct.pack("!I", len(data)) + data
    sent = 0
    if fds:
        sent = sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent < len(payload):  # never an empty send: the peer may have read it all and closed already (EPIPE)
        sock.sendall(payload[sent:])


def recv_msg(sock: socket.socket, with_fds: bool = False) -> tuple[dict | None, list[int]]:
    """One message (None at end of stream) and the descriptors that came with it. Reads exactly one
    message's bytes, never into the next (the server may send the pid and the exit status back to back)."""
    fds: list[int] = []
    head = b""
    while len(head) < 4:
        if with_fds and not head:
            chunk, anc, _, _ = sock.recvmsg(4, socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[:len(payload) - len(payload) % 4])
                    fds += list(a)
        else:
            chunk = sock.recv(4 - len(head))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        head += chunk
    (n,) = struct.unpack("!I", head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(min(n - len(body), 1 << 20))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        body += chunk
    return json.loads(body), fds
