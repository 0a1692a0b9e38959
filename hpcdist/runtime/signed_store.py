"""hpcdist's own messages in the job's rendezvous store, signed so that no one else can write them
(rank side; the submit side and the local controller make the key).

torch's TCPStore has no authentication: anyone who reaches its port lists every key and sets any
of them. So every value hpcdist itself writes there (a rank's seat and check-out, the host table,
the failure that stops a ``python`` job, a roll-call answer, a beat) carries an HMAC-SHA256 of the
key's full name, the writer, a sequence number and the value, made with a key only this user's
ranks hold; a reader takes a value whose MAC does not match for absent, logs one warning naming the
key, and keeps waiting for (or re-reads) the genuine one within its usual timeout. The sequence
grows with every write of one writer (one SignedStore: a rank) to one key, and a reader remembers the
last it accepted per key and writer: a genuine value written back after a newer one (a replayed
beat) is refused as a replay, logged once as a forgery is, and counts as absent.
A forged value set first therefore never
blocks the real one: a later ``set`` replaces it, and the first-wins ``compare_set`` of a failure
replaces a forged holder. Integer counters (``add``) cannot carry a MAC: whoever forges them can
only delay a job or end it early, as deleting its keys can; hpcdist decides nothing from a counter
alone (the genuine per-rank keys behind it are read before anything is acted on).

The key, by what the launch has (``key_file``, ``for_rank0``, ``from_rank0``):
- a job submitted through submitit (``hpcdist submit``, ``hpcdist.Executor``, the local site): a
  random key in a 0600 file of the job's submitit folder (``hpcdist.config.paths.job_key``),
  written by the submit side before the ranks can start (``new_key``, ``place_key``; the local
  controller's ``make_key``) and read on every node from the shared storage, without following a
  link, only when it is this user's own regular 0600 file (``read_key``);
- no such folder (``srun``/``mpirun`` by hand): a random key rank 0 sends through its private
  channel, the 0600 endpoint file or the MPI message;
- neither (torchrun's or a hand-set ``env://`` store, the host-list fallback, outside a submitted
  job): no MAC, said in the rank's log.
The key is never in a key name, a log line or a file another user can read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import BootstrapError
from hpcdist.polling import poll_until

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("hpcdist")

KEY_BYTES = 32
KEY_WAIT_S = 5.0  # how long a rank waits for a submitted job's key file it does not see yet (shared storage lags)
_POLL_S = 0.05  # how often a reader re-reads a key whose value is forged
_MAC_LEN = 64  # hex digits of an HMAC-SHA256
_WRITER_LEN, _SEQ_LEN = 16, 16  # hex digits of the writer's id and of the sequence number, after the MAC
_HEAD = _MAC_LEN + _WRITER_LEN + _SEQ_LEN
_ABSENT = "\0hpcdist: no such key\0"  # compare_set's answer for an absent key (see `_peek`)


class SignedStore:
    """A store (rank 0's, under the launch's prefix `prefix`) whose values are signed with `secret`;
    without a secret it is the plain store. ``plain`` is for torch's own keys (the process group)."""

    def __init__(self, plain: dist.Store, secret: bytes | None, prefix: str = "") -> None:
        self.plain: Any = plain  # torch's stubs say str values (and no `timeout`); the binding takes bytes
        self.secret, self.prefix = secret, prefix
        self._warned: set[tuple[str, bytes]] = set()
        self.writer = secrets.token_hex(_WRITER_LEN // 2).encode()  # this store's writes, told from other ranks'
        self._written: dict[str, int] = {}  # key -> the sequence of this writer's last write
        self._accepted: dict[tuple[str, bytes], tuple[int, bytes]] = {}  # (key, writer) -> (sequence, raw) read

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.plain.timeout.total_seconds())

    def set(self, key: str, value: str | bytes) -> None:
        self.plain.set(key, self._seal(key, _bytes(value)))

    def add(self, key: str, amount: int) -> int:
        """A counter, as torch's: no MAC (see the module's docstring)."""
        return int(self.plain.add(key, amount))

    def peek(self, key: str) -> bytes | None:
        """The genuine value of `key` now, or None (absent, or forged: logged); never waits."""
        raw = self._peek(key)
        return None if raw is None else self._open(key, raw)

    def look(self, key: str) -> tuple[bytes | None, bool]:
        """The genuine value of `key` now (None: absent, forged or replayed), and whether the key
        holds anything at all (a value refused is a sign that someone wrote over the genuine one)."""
        raw = self._peek(key)
        return (None, False) if raw is None else (self._open(key, raw), True)

    def check(self, keys: Sequence[str]) -> bool:
        """Every key in `keys` holds a genuine value now."""
        if self.secret is None:
            return bool(self.plain.check(list(keys)))
        return all(self.peek(k) is not None for k in keys)

    def get(self, key: str) -> bytes:
        """The genuine value of `key`, waiting up to the store's timeout for one."""
        if self.secret is None:
            return bytes(self.plain.get(key))
        now = self.peek(key)
        return now if now is not None else self._genuine([key], self.timeout.total_seconds())[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        if self.secret is None:
            return [bytes(v) for v in self.plain.multi_get(list(keys))]
        return self._genuine(keys, self.timeout.total_seconds())

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Until every key in `keys` holds a genuine value (a forged one is waited past)."""
        limit = self.timeout if timeout is None else timeout
        if self.secret is None:
            self.plain.wait(list(keys), limit)
        else:
            self._genuine(keys, limit.total_seconds())

    def fetch(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        """The genuine values of `keys`, waiting up to `timeout` for every one: ``wait`` and
        ``multi_get`` in one (a value is read once, not once to check and once to use)."""
        if self.secret is None:
            self.plain.wait(list(keys), timeout)
            return [bytes(v) for v in self.plain.multi_get(list(keys))]
        return self._genuine(keys, timeout.total_seconds())

    def read(self, keys: Sequence[str], timeout: timedelta) -> list[bytes | None]:
        """The values of `keys`, every one present (waiting up to `timeout` for that), in one read:
        each genuine value, or None for a forged or replayed one (logged), never read again (``fetch``
        re-reads every key until all are genuine)."""
        self.plain.wait(list(keys), timeout)
        raw = [bytes(v) for v in self.plain.multi_get(list(keys))]
        return [self._open(k, v) for k, v in zip(keys, raw, strict=True)]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """torch's ``compare_set`` over genuine values, a forged value counting as absent: with
        `expected` "" the first genuine writer wins, and a forged holder is replaced, never kept.
        Returns the genuine value held afterwards ("" when only a forger kept writing)."""
        want = _bytes(desired)
        mine = self._seal(key, want)
        was = _bytes(expected)
        raw_expected = b""
        if was:  # the raw value held, when it is the genuine `was` (a sealed value is never made twice)
            held_now = self._peek(key)
            raw_expected = held_now if held_now is not None and self._open(key, held_now) == was else _ABSENT.encode()
        for _ in range(16):  # a forger racing every round only delays the failure being posted
            held = bytes(self.plain.compare_set(key, raw_expected, mine))
            if held == mine:
                return want
            opened = self._open(key, held)
            if opened is not None or was:
                return opened if opened is not None else b""
            raw_expected = held  # a forged holder: replace exactly it
        return b""

    def _genuine(self, keys: Sequence[str], timeout_s: float) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.001)
            opened = self.read(keys, timedelta(seconds=left))  # torch's timeout error past the deadline
            if all(v is not None for v in opened):
                return [v for v in opened if v is not None]
            if time.monotonic() >= deadline:
                forged = [k for k, v in zip(keys, opened, strict=True) if v is None]
                raise TimeoutError(f"no genuine value of {', '.join(self._full(k) for k in forged)} within "
                                   f"{timeout_s:g} s (only forged ones)")
            time.sleep(_POLL_S)

    def _peek(self, key: str) -> bytes | None:
        """The raw value of `key`, or None when absent, in one request that never waits:
        ``compare_set`` with an expected value no key holds answers the value (or, for an absent
        key, the expected value) and changes nothing; ``check`` then ``get`` would wait for a key
        deleted in between."""
        raw = bytes(self.plain.compare_set(key, _ABSENT, _ABSENT))
        return None if raw == _ABSENT.encode() else raw

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _mac(self, key: str, signed: bytes) -> bytes:
        assert self.secret is not None
        message = b"hpcdist-store-2\0" + self._full(key).encode() + b"\0" + signed
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest().encode()

    def _seal(self, key: str, value: bytes) -> bytes:
        """MAC, writer, sequence, value: the sequence above this writer's last one for `key` (the
        clock's nanoseconds where higher, so a value of this writer is never sealed twice)."""
        if self.secret is None:
            return value
        seq = max(self._written.get(key, 0) + 1, time.time_ns())
        self._written[key] = seq
        signed = self.writer + f"{seq:0{_SEQ_LEN}x}".encode() + value
        return self._mac(key, signed) + signed

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """`raw`'s value when its MAC is this job's for `key` and its sequence is not older than what
        this reader last accepted from its writer; else None, and one warning per value."""
        if self.secret is None:
            return raw
        mac, signed = raw[:_MAC_LEN], raw[_MAC_LEN:]
        if len(raw) < _HEAD or not hmac.compare_digest(mac, self._mac(key, signed)):
            self._warn(key, raw, f"{len(raw)} bytes; its MAC is not this job's", "forged or altered")
            return None
        writer, value = signed[:_WRITER_LEN], signed[_HEAD - _MAC_LEN:]
        seq = int(signed[_WRITER_LEN:_HEAD - _MAC_LEN], 16)
        last = self._accepted.get((key, writer))
        if last is not None and (seq < last[0] or (seq == last[0] and raw != last[1])):
            self._warn(key, raw, f"sequence {seq}, older than {last[0]} read before from the same rank",
                       "replayed")
            return None
        self._accepted[(key, writer)] = (seq, raw)  # the same value read again is the current value, no replay
        return value

    def _warn(self, key: str, raw: bytes, why: str, what: str) -> None:
        if (key, raw) not in self._warned:
            self._warned.add((key, raw))
            log.warning("ignored a %s value of %s in the job's store (%s): someone who can reach the store's port "
                        "wrote it; the job goes on", what, self._full(key), why)


def signed(store: Any) -> SignedStore:
    """`store` as a SignedStore: itself, or a plain torch store wrapped without a key."""
    return store if isinstance(store, SignedStore) else SignedStore(store, None)


def plain(store: Any) -> dist.Store:
    """The torch store under `store`, for torch's own keys."""
    return store.plain if isinstance(store, SignedStore) else store


_JOB: list[SignedStore] = []


def use(store: SignedStore) -> None:
    """The job's store in this process, for the roll call after a failure (``hpcdist.runtime.rollcall``)."""
    _JOB[:] = [store]


def job_store() -> SignedStore | None:
    return _JOB[0] if _JOB else None


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


# The key: made on the submit side, read on the nodes.

def key_file(env: Mapping[str, str], job_id: str | None) -> Path | None:
    """This rank's job key file (in submitit's folder of the job, as ``SUBMITIT_FOLDER`` names it);
    None outside a job submitted through submitit."""
    folder = env.get("SUBMITIT_FOLDER", "")
    if not folder or not job_id:
        return None
    from submitit.core.utils import JobPaths

    from hpcdist.config.paths import job_key

    return job_key(JobPaths(folder, job_id=job_id).folder, job_id)


def new_key(folder: Path) -> Path:
    """A fresh key in a new 0600 file of `folder`, under a temporary name (``place_key`` moves it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".{uuid.uuid4().hex}.key.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES))
        f.flush()
        os.fsync(f.fileno())
    return path


def place_key(tmp: Path, folder: Path, job_id: str) -> Path:
    """The key `tmp` (``new_key``) as the key file of job `job_id` in `folder`, whole or not at all."""
    from hpcdist.config.paths import job_key  # here: the local controller loads the config models only now

    path = job_key(folder, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path


def make_key(folder: Path, job_id: str) -> Path:
    """A fresh key for job `job_id` in `folder` (the local controller's, before its ranks start)."""
    return place_key(new_key(folder), folder, job_id)


def read_key(path: Path) -> bytes | None:
    """The key in `path`; None while it is absent. BootstrapError, at once, for anything but this
    user's own regular 0600 file in folders no one else may write (``hpcdist.files.trust``'s
    check, read from the descriptor it checked): a key another user could have planted or read
    is a key she knows."""
    from hpcdist.files.trust import UntrustedFileError, read_trusted

    try:
        text = read_trusted(path, private=True, limit=2 * KEY_BYTES)
    except FileNotFoundError:
        return None
    except (UntrustedFileError, OSError) as exc:
        raise BootstrapError(f"the job's store key: {exc}; remove it and submit the job again") from exc
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise BootstrapError(f"the job's store key {path} holds no key of {KEY_BYTES} bytes; remove it and submit "
                             f"the job again")
    return key


def wait_for_key(path: Path | None, wait_s: float) -> bytes | None:
    """The key in `path`, waiting up to `wait_s` for a file the shared storage does not show yet."""
    return None if path is None else poll_until(lambda: read_key(path), wait_s, 0.1)


def for_rank0(path: Path | None) -> tuple[bytes, dict[str, Any]]:
    """Rank 0's key where it has a private channel, and what the channel carries of it: the job's
    key file when it has one (the others read their own copy), else a fresh key sent whole."""
    key = wait_for_key(path, KEY_WAIT_S)
    if key is not None:
        return key, {"keyed": True}
    key = secrets.token_bytes(KEY_BYTES)
    return key, {"nonce": key.hex()}


def from_rank0(message: Mapping[str, Any], path: Path | None, timeout: float, rank: int) -> bytes | None:
    """This rank's key from rank 0's channel `message` (``for_rank0``)."""
    if message.get("keyed"):
        key = wait_for_key(path, timeout)
        if key is None:
            raise BootstrapError(f"rendezvous: rank 0 signs the job's store messages with the job's key file "
                                 f"{path}, which rank {rank} did not see within {timeout:g} s; the job folder is "
                                 f"not on storage every node shares: check storage.logs in the site config")
        return key
    try:
        return bytes.fromhex(str(message.get("nonce", ""))) or None
    except ValueError as exc:
        raise BootstrapError(f"rendezvous: rank 0's endpoint holds no valid key (rank {rank}); rank 0's log "
                             f"says more") from exc


def alone(path: Path | None, how: str) -> bytes | None:
    """Each rank's key where the launch has no private channel (`how`: env, hostlist): the job's key
    file, or none (said once in the log)."""
    key = wait_for_key(path, KEY_WAIT_S)
    if key is None:
        log.info("the job's store (via %s) holds hpcdist's messages without a MAC: no job key file and no private "
                 "channel from rank 0; anyone who reaches its port can write them (docs/on-the-nodes.md)", how)
    return key
