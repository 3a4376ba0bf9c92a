"""The run secret and the authenticated channel of dilocox's own TCP services (docs/SECURITY.md).

Every process of one run holds the same secret (``security.secret_file``: 32 random bytes, hex, a file
of mode 0600 that ``dilocox swarm`` writes when absent and passes to its peers by path, never on a
command line). A connection is authenticated both ways by an HMAC-SHA256 challenge-response over the
secret, the construction of Python's own ``multiprocessing.connection`` (``deliver_challenge`` /
``answer_challenge``), here mutual and with a per-connection key:

    server -> client   "DXA1" + 32-byte random challenge Cs
    client -> server   32-byte random challenge Cc + HMAC(secret, "client" | Cs | Cc)
    server -> client   HMAC(secret, "server" | Cs | Cc)
    session key        K = HMAC(secret, "session" | Cs | Cc)

After that every message carries ``HMAC(K, direction | sequence number | message bytes)`` (``Sealer``):
a message changed on the way, replayed within the connection or from another one, or sent in the other
direction fails its check. With ``security.encrypt`` the message is instead sealed whole with
ChaCha20-Poly1305 (``Crypter``: key ``HMAC(K, "chacha20-poly1305")``, nonce = direction | sequence number; the
same checks, and nobody on the path reads it; the AEAD of TLS 1.3 and WireGuard, 1.8x AES-GCM's encryption rate
on the development CPU). The primitives are the standard library's ``hmac``, ``hashlib`` and ``secrets`` and, for
encryption, the ``cryptography`` package's ChaCha20Poly1305; nothing here is a cipher of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import time

MAGIC = b"DXA1"
CHALLENGE_BYTES = 32
MAC_BYTES = 32  # SHA-256
SECRET_MIN_BYTES = 16


class AuthError(ConnectionError):
    """The other side does not hold the run secret, or a message failed its check."""


class SecretError(ValueError):
    """The secret file is missing, unreadable, too short, or readable by others."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def create_secret(path: str) -> bytes:
    """Write a new random secret to ``path`` with mode 0600 (created exclusively: never overwrites)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    key = secrets.token_hex(32)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.link(tmp, path)  # whole or absent (a reader never sees it half-written); FileExistsError if it exists
    finally:
        os.unlink(tmp)
    return bytes.fromhex(key)


def load_secret(path: str) -> bytes:
    """The secret in ``path``: hex (64 digits from ``create_secret``) or any text of >= 16 bytes.

    Refuses a file that the group or others may read (the fix: ``chmod 600 <path>``)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SecretError(f"security.secret_file={path!r}: {e.strerror}; create it with `dilocox secret {path}`") from e
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"security.secret_file={path!r} has mode {stat.S_IMODE(st.st_mode):o}: others may read it; "
            f"run `chmod 600 {path}`"
        )
    with open(path, "rb") as f:
        raw = f.read(4096).strip()
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = raw
    if len(key) < SECRET_MIN_BYTES:
        raise SecretError(
            f"security.secret_file={path!r} holds {len(key)} bytes; a secret needs >= {SECRET_MIN_BYTES} "
            f"(`dilocox secret <path>` writes 32 random ones)"
        )
    return key


def secret_for(sec, writer: str) -> bytes | None:
    """The run secret a process of this run uses, from its ``security`` config section: None when
    ``security.authenticate`` is false, else the file's secret; ``writer`` names who writes the file when the
    setting is empty (the one-line fix in the error)."""
    if not sec.authenticate:
        return None
    if not sec.secret_file:
        raise SecretError(
            f"security.secret_file is empty and security.authenticate is true: {writer}; a process started by hand "
            "needs --security.secret_file=PATH (the run's file, mode 0600: `dilocox secret PATH` writes one)"
        )
    return load_secret(sec.secret_file)


def load_or_create_secret(path: str) -> bytes:
    """``load_secret(path)``, after creating the file (0600) if there is none."""
    if not os.path.exists(path):
        try:
            return create_secret(path)
        except FileExistsError:  # another process of the run created it first
            pass
    return load_secret(path)


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("authentication timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthError("connection closed during authentication")
        buf += chunk
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("authentication timed out")
    sock.settimeout(left)
    sock.sendall(data)


def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> bytes:
    """Authenticate the client that connected to ``sock``; return the session key (AuthError if it fails)."""
    cs = secrets.token_bytes(CHALLENGE_BYTES)
    _send(sock, MAGIC + cs, deadline)
    reply = _recv(sock, CHALLENGE_BYTES + MAC_BYTES, deadline)
    cc, proof = reply[:CHALLENGE_BYTES], reply[CHALLENGE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", cs, cc)):
        raise AuthError("the client does not hold the run secret")
    _send(sock, _mac(secret, b"server", cs, cc), deadline)
    return _mac(secret, b"session", cs, cc)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> bytes:
    """Authenticate the server ``sock`` is connected to and prove the secret to it; return the session key."""
    key, expect = client_hello(sock, secret, deadline)
    check_server_proof(_recv(sock, MAC_BYTES, deadline), expect)
    return key


def client_hello(sock: socket.socket, secret: bytes, deadline: float) -> tuple[bytes, bytes]:
    """The client's half without waiting for the server's proof: (session key, the proof the server must send).

    A caller may send its (sealed) request right away and check the proof (``check_server_proof``) before it
    reads the reply, which saves a round trip per connection on a far link; the request then reaches a server
    before it proved the secret (it cannot forge a reply; it can read the request, as anyone on the path can,
    since nothing is encrypted)."""
    hello = _recv(sock, len(MAGIC) + CHALLENGE_BYTES, deadline)
    if hello[: len(MAGIC)] != MAGIC:
        raise AuthError("the server did not start a dilocox authentication (no run secret on its side?)")
    cs = hello[len(MAGIC) :]
    cc = secrets.token_bytes(CHALLENGE_BYTES)
    _send(sock, cc + _mac(secret, b"client", cs, cc), deadline)
    return _mac(secret, b"session", cs, cc), _mac(secret, b"server", cs, cc)


def check_server_proof(proof: bytes, expect: bytes) -> None:
    if not hmac.compare_digest(proof, expect):
        raise AuthError("the server does not hold the run secret")


def sign_value(secret: bytes | None, key: str, value: str) -> str:
    """``value`` with a tag that binds it to the store ``key`` and the run secret (``value`` itself without one).

    For the entries of a store that authenticates nobody (torch's TCPStore: the SWARM address book): a stranger
    who reaches the store can still write, but what it writes fails ``open_value`` on every peer."""
    if secret is None:
        return value
    return value + "#" + _mac(secret, b"store", key.encode(), value.encode()).hex()


def open_value(secret: bytes | None, key: str, raw: str) -> str:
    """The value of a ``sign_value`` entry, after checking its tag (AuthError: not written by the run)."""
    if secret is None:
        return raw
    value, sep, tag = raw.rpartition("#")
    want = _mac(secret, b"store", key.encode(), value.encode()).hex()
    if not sep or not tag.isascii() or not hmac.compare_digest(tag, want):
        raise AuthError(f"the store entry {key!r} is not signed with the run secret (written by a stranger?)")
    return value


class Sealer:
    """Per-connection message MACs: ``seal`` for what this side sends, ``check`` for what it receives.

    ``role`` is "client" or "server"; each direction has its own sequence counter, so a message
    replayed, reordered, or reflected back to its sender fails."""

    def __init__(self, key: bytes, role: str) -> None:
        if role not in ("client", "server"):
            raise ValueError(f"role={role!r} is not client or server")
        self.key = key
        self._out_dir = role.encode()
        self._in_dir = b"server" if role == "client" else b"client"
        self._out_seq = 0
        self._in_seq = 0

    def _start(self, direction: bytes, seq: int):
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        h.update(direction + b"|" + seq.to_bytes(8, "big"))
        return h

    def sealer(self):
        """A running MAC for the next message this side sends (``update`` each frame, ``digest`` last)."""
        h = self._start(self._out_dir, self._out_seq)
        self._out_seq += 1
        return h

    def checker(self):
        """A running MAC for the next message this side receives (compare with ``verify``)."""
        h = self._start(self._in_dir, self._in_seq)
        self._in_seq += 1
        return h

    @staticmethod
    def verify(h, tag: bytes) -> None:
        if not hmac.compare_digest(h.digest(), tag):
            raise AuthError("a message failed its authentication check (changed, replayed or not from the peer)")


class Crypter:
    """Per-connection ChaCha20-Poly1305 (``security.encrypt``): ``encrypt`` what this side sends, ``decrypt`` what it
    receives (AuthError when a message was changed, replayed, reordered or reflected). The key is derived from
    the handshake's session key; the 12-byte nonce is the direction (1 byte) and the message's sequence number in
    that direction (11 bytes), so no nonce is ever used twice under one key."""

    TAG_BYTES = 16

    def __init__(self, key: bytes, role: str) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        except ImportError as e:  # pragma: no cover - cryptography is in requirements.txt
            raise SecretError(f"security.encrypt needs the cryptography package (pip install cryptography): {e}")
        if role not in ("client", "server"):
            raise ValueError(f"role={role!r} is not client or server")
        self._aead = ChaCha20Poly1305(_mac(key, b"chacha20-poly1305"))
        self._out_dir = b"\x01" if role == "client" else b"\x02"
        self._in_dir = b"\x02" if role == "client" else b"\x01"
        self._out_seq = 0
        self._in_seq = 0

    def encrypt(self, data: bytes) -> bytes:
        nonce = self._out_dir + self._out_seq.to_bytes(11, "big")
        self._out_seq += 1
        return self._aead.encrypt(nonce, data, None)

    def decrypt(self, data: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        nonce = self._in_dir + self._in_seq.to_bytes(11, "big")
        self._in_seq += 1
        try:
            return self._aead.decrypt(nonce, data, None)
        except InvalidTag:
            raise AuthError("a message failed its decryption check (changed, replayed or not from the peer)") from None
