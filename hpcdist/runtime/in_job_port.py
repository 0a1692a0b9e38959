"""The in-job supervisor's end of its line to the ranks (``hpcdist.runtime.in_job_link`` has the
protocol and the rank's end): its listening port, every rank's connection as it holds it, and
what it refuses there.

The port is reachable by every user with a step on the batch node. A connection counts once its
first line, ``hello NONCE STEP RANK NODE``, is signed with the job's key as sequence 0 on a nonce
never seen, naming a node of the step; every later line is signed on that nonce with a sequence
above the last taken. A forged, replayed or foreign line is said in the batch log (at most
``MAX_WARNINGS`` such lines) and ignored. Connections are bounded: at most ``MAX_PENDING`` (and one
per rank) at once that have not said who they are, each for ``HELLO_S``; of those at most
``MAX_FOREIGN`` (and one per rank) from an address Slurm does not give for the job's nodes (a rank
from one, a site's data network, is taken on the job's key and its address learnt); one per rank (a
newer hello of a rank drops the older connection, its process gone). Only a connection that said who
it is makes events: one that opens and closes, or says nothing, steers nothing.
"""

from __future__ import annotations

import selectors
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hpcdist.runtime.in_job_link import LINE_MAX, RANK, SUPERVISOR, seal, unseal

KEEPALIVE = (1, 1, 2)  # seconds idle, seconds between probes, probes: a silent node is noticed in ~3 s
HELLO_S = 5.0  # how long a new connection may take to say, signed, who it is
MAX_PENDING = 16  # connections at once that have not said who they are (from the job's nodes' addresses)
MAX_FOREIGN = 2  # of those, from an address Slurm does not give for any of the job's nodes
MAX_WARNINGS = 20  # lines the supervisor writes of what it refused; then one saying it stops saying so


@dataclass
class Link:
    """A connection as the supervisor holds it: where from, and once it said who it is (signed),
    its node, rank and nonce; whether its job failed and it waits for the supervisor's word, or
    succeeded."""

    peer: str = ""
    opened: float = 0.0
    node: str = ""
    rank: int = -1
    nonce: str = ""
    heard: int = 0  # the sequence of the rank's last line taken
    sent: int = 0  # the sequence of the supervisor's last line to it
    buffer: bytes = b""
    known: bool = True  # from an address Slurm gives for one of the job's nodes
    failed: str = ""  # its job failed: "comm" (a collective or rendezvous: a peer's fault) or "own"
    done: bool = False  # its job succeeded: the process ends next


class Links:
    """The supervisor's listening socket and every rank's connection, each kept with TCP keepalives
    (``KEEPALIVE``): a node whose kernel stops answering (dead, or cut off) is noticed in about
    3 s; a rank's process that ends closes its connection at once. Only lines signed with `key`
    count; `known` holds the addresses of the job's nodes (None: not known, every address is
    held to the tighter bound of a foreign one)."""

    def __init__(self, address: str, key: bytes, known: set[str] | None = None, world: int = 1) -> None:
        self.server = socket.create_server((address, 0))
        self.server.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ)
        self.address = f"{address}:{self.server.getsockname()[1]}"
        self.key, self.known = key, known
        self.steps: set[str] = set()  # the Slurm step ids the ranks named
        self.nonces: set[str] = set()  # every hello's nonce taken: a replayed hello is refused
        self.refused = 0  # lines and connections refused, as said in the batch log
        # every rank may be connecting at once (from a data network's addresses too), beside the bound
        self.max_pending, self.max_foreign = MAX_PENDING + world, MAX_FOREIGN + world

    def events(self, timeout: float, nodes: Sequence[str], restart: int) -> list[tuple[socket.socket | None, Link,
                                                                                    OSError | None]]:
        """What the ranks' connections did within `timeout`: a line read (the socket), or an end
        (None, with the error when it did not end cleanly); new connections accepted within the
        bounds. A hello naming a node outside `nodes` (the step's) is ignored, and so is a failure
        in a run before `restart` (the current restart number): the rank was told ``again``
        already. A connection that never said who it is makes no event."""
        out: list[tuple[socket.socket | None, Link, OSError | None]] = []
        for key, _ in self.sel.select(timeout):
            if key.fileobj is self.server:
                self._accept()
                continue
            sock, link = key.fileobj, key.data
            assert isinstance(sock, socket.socket)
            error: OSError | None = None
            try:
                data = sock.recv(4096)
            except OSError as exc:
                data, error = b"", exc
            if data:
                self._lines(sock, link, data, nodes, restart)
                if link.rank >= 0:
                    out.append((sock, link, None))
                continue
            self._drop(sock)
            if link.rank >= 0:
                out.append((None, link, error))
        now = time.monotonic()
        for key in list(self.sel.get_map().values()):  # a connection that does not say who it is goes
            if key.fileobj is not self.server and key.data.rank < 0 and now - key.data.opened > HELLO_S:
                self._refuse(key.data, f"said nothing signed within {HELLO_S:g} s")
                self._drop(key.fileobj)  # type: ignore[arg-type]
        return out

    def _accept(self) -> None:
        try:
            conn, peer = self.server.accept()
        except BlockingIOError:  # the peer left before it was taken
            return
        except OSError as exc:  # out of descriptors: the next round tries again
            self._refuse(Link(), f"could not be taken ({exc.strerror})")
            return
        conn.setblocking(True)
        link = Link(peer=str(peer[0]), opened=time.monotonic(), known=self.known is not None and peer[0] in self.known)
        waiting = [k.data for k in self.sel.get_map().values() if k.fileobj is not self.server and k.data.rank < 0]
        foreign = sum(not w.known for w in waiting)
        if len(waiting) >= self.max_pending or (not link.known and foreign >= self.max_foreign):
            conn.close()
            self._refuse(link, f"closed: {len(waiting)} connections already wait to say who they are")
            return
        _keepalive(conn)
        self.sel.register(conn, selectors.EVENT_READ, link)

    def _lines(self, sock: socket.socket, link: Link, data: bytes, nodes: Sequence[str], restart: int) -> None:
        link.buffer += data
        while b"\n" in link.buffer:
            raw, _, link.buffer = link.buffer.partition(b"\n")
            line = raw.decode(errors="replace")
            if link.rank < 0:
                if not self._hello(sock, link, line, nodes):
                    return  # dropped: nothing more is read from it
                continue
            taken = unseal(self.key, link.nonce, RANK, line, link.heard)
            if taken is None:
                self._refuse(link, "sent a line not signed with the job's key on its connection (forged or replayed)")
                continue
            link.heard, text = taken
            words = text.split()
            if len(words) == 3 and words[0] == "failed" and words[2].isdigit():
                if int(words[2]) >= restart:
                    link.failed = "comm" if words[1] == "comm" else "own"
            elif words == ["done"]:
                link.done = True
        link.buffer = link.buffer[-LINE_MAX:]

    def _hello(self, sock: socket.socket, link: Link, line: str, nodes: Sequence[str]) -> bool:
        """A connection's first line: ``hello NONCE STEP RANK NODE``, signed as sequence 0 on its own
        nonce, a nonce never seen, a node of the step: the rank it names (an older connection of
        the same rank, its process gone, is dropped). False: the connection was dropped."""
        words = line.split()
        nonce = words[3] if len(words) == 7 and words[2] == "hello" else ""
        taken = unseal(self.key, nonce, RANK, line, -1) if nonce else None
        if taken is None or taken[0] != 0 or nonce in self.nonces:
            self._refuse(link, "said who it is without the job's key (forged, replayed or another job's)")
            self._drop(sock)
            return False
        step, rank, node = words[4:7]
        if node not in nodes or not rank.isdigit():
            self._drop(sock)  # a rank of a step that ended (its node left the job): not this step's
            return False
        self.nonces.add(nonce)
        for key in list(self.sel.get_map().values()):
            if key.fileobj is not self.server and key.data.rank == int(rank):
                self._drop(key.fileobj)  # type: ignore[arg-type]
        if not link.known:
            print(f"hpcdist: in-job: rank {rank} on {node} connects from {link.peer}, an address Slurm does not give "
                  f"for the job's nodes; taken on the job's key", file=sys.stderr, flush=True)
            if self.known is not None:
                self.known.add(link.peer)
        link.node, link.rank, link.nonce = node, int(rank), nonce
        if step.isdigit():
            self.steps.add(step)
        link.sent += 1
        try:
            sock.sendall(seal(self.key, nonce, SUPERVISOR, link.sent, "hello"))  # the rank waits for this word
        except OSError:
            pass  # its end comes as an event
        return True

    def _refuse(self, link: Link, why: str) -> None:
        self.refused += 1
        if self.refused <= MAX_WARNINGS:
            more = "" if self.refused < MAX_WARNINGS else f"; further refusals ({MAX_WARNINGS} said) are not said"
            print(f"hpcdist: warning: in-job: a connection to the supervisor's port from {link.peer or '?'} {why}: "
                  f"ignored, the job goes on{more}", file=sys.stderr, flush=True)

    def _drop(self, sock: socket.socket) -> None:
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def ranks(self) -> list[Link]:
        """The connections of ranks that said who they are."""
        return [key.data for key in self.sel.get_map().values() if key.fileobj is not self.server
                and key.data.rank >= 0]

    def connected(self, nodes: set[str]) -> int:
        return sum(1 for link in self.ranks() if link.node in nodes)

    def tell(self, word: str, ranks: Sequence[Link] | None = None) -> None:
        """`word` to `ranks` (all that said who they are), signed for each one's connection."""
        for key in list(self.sel.get_map().values()):
            link = key.data
            if key.fileobj is not self.server and link.rank >= 0 and (ranks is None or any(link is r for r in ranks)):
                link.sent += 1
                try:
                    key.fileobj.sendall(seal(self.key, link.nonce, SUPERVISOR, link.sent, word))  # type: ignore[union-attr]
                except OSError:
                    pass  # its end comes as an event
                link.failed = ""

    def close_all(self) -> None:
        """Every connection closed (the listening socket stays); the step ids forgotten."""
        for key in list(self.sel.get_map().values()):
            if key.fileobj is not self.server:
                self._drop(key.fileobj)  # type: ignore[arg-type]
        self.steps = set()


def _keepalive(sock: socket.socket) -> None:
    idle, interval, count = KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
