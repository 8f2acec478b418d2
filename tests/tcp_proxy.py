"""A TCP forwarder for partition tests: frozen, it holds every byte in both directions with the
sockets left open (no FIN, no RST), as a network that silently stops delivering does."""

from __future__ import annotations

import socket
import threading

CHUNK = 65536


class TcpProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream_port`, one thread per direction.

    `freeze()` stops delivery: bytes already read wait in the proxy, the rest in the kernel's
    buffers; a connection opened meanwhile is accepted but not forwarded. `resume()` delivers
    everything that was held, in order. `cut()` closes every open connection (both sides
    see it) and forwards new ones again.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True).start()

    @property
    def url(self) -> str:
        """A redis:// URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def freeze(self) -> None:
        """Deliver nothing more, in either direction, until resume() or cut()."""
        self._flowing.clear()

    def resume(self) -> None:
        """Deliver what was held, then forward as before."""
        self._flowing.set()

    def cut(self) -> None:
        """Close every open connection, dropping what was held; new ones are forwarded."""
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            _close(s)
        self._flowing.set()

    def close(self) -> None:
        """Stop listening and close everything."""
        self._closed = True
        _close(self._listener)
        self.cut()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._open, args=(client,), daemon=True).start()

    def _open(self, client: socket.socket) -> None:
        self._track(client)
        self._flowing.wait()
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            _close(client)
            return
        self._track(upstream)
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.add(s)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._flowing.wait()
                data = src.recv(CHUNK)
                if not data:
                    break
                # A recv that was already waiting when the freeze began holds its bytes here.
                self._flowing.wait()
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # pass the end of the stream on
        except OSError:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    except OSError:
        pass
    s.close()
