"""A joiner's state transfer (torchft's "heal") with nothing unpickled, every length bounded, both sides
authenticated (issue 21 item 2; docs/SECURITY.md).

torchft's default ``HTTPTransport`` serves the live replica's state as a ``torch.save`` stream over plain HTTP,
and the healing replica loads it with ``weights_only=False`` (torchft 0.2.0, torchft/checkpointing/http_transport.py,
``recv_checkpoint``: checked again for issue 42): whoever answers at the advertised address runs code in the replica
that heals. dilocox never lets a replica use it: ``StateTransport`` takes its place (torchft's
``CheckpointTransport`` interface, duck-typed: nothing here imports torchft; passed to every ``Manager`` dilocox
builds, elastic/group.py), so no replica unpickles a peer's state:

- the state travels over the tensor RPC (``dilocox.net.rpc``): a JSON header and raw tensor
  bytes, the mutual HMAC challenge-response over the run secret and a MAC on every message when the run has a
  secret; a stranger is served nothing and cannot pose as the source;
- its nested structure (dicts, lists, tuples, numbers, strings, booleans, None) is a JSON skeleton whose tensor
  leaves point into the message's tensors (``flatten``/``unflatten``): no object of any other type can come
  out of it, so nothing the sender chooses runs;
- the receiver bounds the message before allocating: header, tensor count, and total tensor bytes against what
  its own run can need (``max_state_bytes``, set from the model by the caller), the skeleton's depth and size.

Serving follows torchft's protocol: ``send_checkpoint(step, state)`` makes the state fetchable for ``step`` (a
request for it that arrives earlier waits, bounded); ``disallow_checkpoint()`` (torchft calls it before the
state may change) waits, bounded, until the replies in flight are sent, then serves nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

from torch import Tensor

from dilocox.net.client import call
from dilocox.net.rpc import WIRE_DTYPES, Limits, NotServing, ProtocolError, RpcServer
from dilocox.net.secure import listen_socket

log = logging.getLogger("dilocox.net.transfer")

SERVICE = "state"  # the service name in every handshake of the state transfer (a SWARM RPC handshake is refused)
SCHEME = "dxstate:"  # the metadata torchft passes between replicas: "dxstate:host:port"
MAX_DEPTH = 32  # nesting of a state dict (an optimizer's state is 4 deep)
MAX_SKELETON_BYTES = 16 << 20  # the JSON of a state's structure: ~40 bytes per leaf
MAX_TENSORS = 1 << 18


class StateFormatError(ValueError):
    """A state that cannot be sent (a leaf of another type) or a received skeleton that is not well-formed."""


def flatten(obj, path: str = "state") -> tuple[object, list[Tensor]]:
    """``obj`` as (JSON skeleton, tensors): tensor leaves become ``{"T": index}``."""
    tensors: list[Tensor] = []

    def enc(x, p: str, depth: int):
        if depth > MAX_DEPTH:
            raise StateFormatError(f"{p}: nested more than {MAX_DEPTH} deep")
        if isinstance(x, Tensor):
            if str(x.dtype).removeprefix("torch.") not in WIRE_DTYPES:
                raise StateFormatError(f"{p}: a {x.dtype} tensor cannot be sent (dtypes: {sorted(WIRE_DTYPES)})")
            tensors.append(x.detach())
            return {"T": len(tensors) - 1}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                return {"d": {k: enc(v, f"{p}.{k}", depth + 1) for k, v in x.items()}}
            if not all(k is None or isinstance(k, (bool, int, float, str)) for k in x):
                raise StateFormatError(f"{p}: a mapping key that is not a number, string, boolean or None")
            return {"m": [[enc(k, f"{p}[key]", depth + 1), enc(v, f"{p}[{k!r}]", depth + 1)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "t": [enc(v, f"{p}[{i}]", depth + 1) for i, v in enumerate(x)]}
        raise StateFormatError(
            f"{p}: a {type(x).__name__} cannot be sent to a joiner (tensors, dicts, lists, tuples, numbers, strings, "
            "booleans and None only)"
        )

    return enc(obj, path, 0), tensors


def unflatten(skeleton: object, tensors: dict[str, Tensor]) -> object:
    """The inverse of ``flatten`` for a skeleton from the network: every node checked, nothing but plain values
    and the message's own tensors comes out (each used at most once)."""
    used: set[str] = set()

    def dec(node, depth: int):
        if depth > MAX_DEPTH:
            raise StateFormatError(f"the state is nested more than {MAX_DEPTH} deep")
        if not isinstance(node, dict) or len(node) != 1:
            raise StateFormatError("a node of the state's skeleton is not a one-key object")
        ((kind, val),) = node.items()
        if kind == "T":
            name = str(val) if type(val) is int else None
            if name is None or name not in tensors or name in used:
                raise StateFormatError(f"the skeleton names tensor {str(val)[:20]!r}, which the message lacks")
            used.add(name)
            return tensors[name]
        if kind == "v":
            if val is not None and not isinstance(val, (bool, int, float, str)):
                raise StateFormatError("a value of the state's skeleton is not a number, string, boolean or null")
            return val
        if kind == "d" and isinstance(val, dict):
            return {k: dec(v, depth + 1) for k, v in val.items()}
        if kind == "m" and isinstance(val, list):
            out = {}
            for pair in val:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise StateFormatError("a mapping entry of the state's skeleton is not [key, value]")
                k = dec(pair[0], depth + 1)
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise StateFormatError("a mapping key of the state's skeleton is not a plain value")
                out[k] = dec(pair[1], depth + 1)
            return out
        if kind in ("l", "t") and isinstance(val, list):
            items = [dec(v, depth + 1) for v in val]
            return items if kind == "l" else tuple(items)
        raise StateFormatError(f"a node of the state's skeleton has the unknown kind {kind[:8]!r}")

    out = dec(skeleton, 0)
    if len(used) != len(tensors):
        raise StateFormatError(f"{len(tensors) - len(used)} tensor(s) of the message are not in its skeleton")
    return out


def parse_metadata(metadata: str) -> str:
    """``dxstate:host:port`` -> ``host:port``; anything else (torchft's ``http://`` of an HTTPTransport, a rogue
    address) is refused: this replica fetches state only with its own protocol."""
    if not isinstance(metadata, str) or not metadata.startswith(SCHEME):
        raise StateFormatError(
            f"the live replica advertises its state at {str(metadata)[:60]!r}, not a dilocox state server "
            f"({SCHEME}host:port): every replica of a run must run this dilocox version"
        )
    return metadata[len(SCHEME) :]


def _bind_address(host: str) -> tuple[str, str]:
    """(address to bind, address to advertise): ``host`` itself when it is an address of this machine; else (a rank
    on another node of a multi-node replica, given the replica's MASTER_ADDR) every interface, advertising this
    machine's host name, as torchft's own transport does."""
    try:
        listen_socket(host, 0).close()  # (an IPv6 address too, as the RpcServer binds it)
        return host, host
    except OSError:
        return "0.0.0.0", socket.gethostname()


class StateTransport:
    """torchft ``CheckpointTransport`` over the authenticated, pickle-free tensor RPC (module docstring).

    ``host``: the address advertised to the other replicas (and bound); ``secret``: the run secret (None: no
    authentication); ``encrypt``: ChaCha20-Poly1305 on the connection (``security.encrypt``); ``max_state_bytes``: the
    most tensor bytes a received state may carry (the caller's bound from its own model; ``set_max_state_bytes``
    changes it once the model is known)."""

    def __init__(
        self,
        host: str,
        timeout_s: float,
        secret: bytes | None,
        max_state_bytes: int = 256 << 20,
        name: str = "heal",
        encrypt: bool = False,
    ) -> None:
        self._timeout_s = float(timeout_s)
        self._secret, self._encrypt = secret, bool(encrypt)
        self._cond = threading.Condition()
        self._step, self._allowed, self._readers = -1, False, 0
        self._skeleton: object = None
        self._error: str | None = None  # why the offered state cannot be sent (told to the joiner)
        self._tensors: dict[str, Tensor] = {}
        self.served = 0  # replies sent (tests, logs)
        self.set_max_state_bytes(max_state_bytes)
        # requests carry no tensors and a tiny header; the reply (the whole state) must be sent within the timeout
        req = Limits(
            max_header=4096,
            max_message_bytes=0,
            max_tensors=0,
            max_connections=16,  # joiners of one step are few; strangers beyond the caps wait in the backlog
            max_unauthenticated=8,
            message_timeout_s=self._timeout_s,
        )
        bind, self._host = _bind_address(host)
        self._server = RpcServer(
            self._handle,
            host=bind,
            port=0,
            name=name,
            secret=secret,
            limits=req,
            encrypt=self._encrypt,
            service=SERVICE,
        )

    def set_max_state_bytes(self, n: int) -> None:
        self._recv_limits = Limits(
            max_header=MAX_SKELETON_BYTES, max_message_bytes=int(n), max_tensors=MAX_TENSORS, max_dims=8
        )

    # ------------------------------------------------------------------ CheckpointTransport
    def metadata(self) -> str:
        return f"{SCHEME}{self._host}:{self._server.addr.rsplit(':', 1)[1]}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: object, timeout: timedelta) -> None:
        # (runs on torchft's quorum thread: an error raised here would fail this LIVE replica's step; a state that
        # cannot be sent is reported to the joiner instead, by the handler)
        try:
            skeleton, tensors, err = *flatten(state_dict), None
        except StateFormatError as e:
            skeleton, tensors, err = None, [], str(e)
            log.error("the state for a joiner cannot be sent: %s", e)
        with self._cond:
            self._skeleton, self._error = skeleton, err
            self._tensors = {str(i): t.cpu() for i, t in enumerate(tensors)}
            self._step, self._allowed = int(step), True
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._allowed = False
            # a reply in flight is bounded by timeout_s from the end of its encoding (the RPC server's send
            # deadline), which started after its reader was counted: 2 x timeout_s covers both, so the state is not
            # changed under a reply that is still being sent
            if not self._cond.wait_for(lambda: self._readers == 0, timeout=2 * self._timeout_s + 1.0):
                log.warning("a joiner's state download did not finish within %.0f s", 2 * self._timeout_s + 1.0)
            self._skeleton, self._tensors = None, {}

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> object:
        addr = parse_metadata(metadata)
        t0 = time.monotonic()
        meta, tensors = call(
            addr, "state", {"step": int(step)}, timeout_s=timeout.total_seconds(), secret=self._secret,
            limits=self._recv_limits, encrypt=self._encrypt, service=SERVICE, keep=False,
        )  # fmt: skip
        if meta.get("step") != int(step) or "skeleton" not in meta:
            raise ProtocolError(
                f"the state server at {addr} answered with step {str(meta.get('step'))[:20]!r}, not {step}"
            )
        sd = unflatten(meta["skeleton"], tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        log.info("received the state of step %d from %s: %.1f MB in %.2f s", step, addr, nbytes / 1e6,
                 time.monotonic() - t0)  # fmt: skip
        return sd

    def shutdown(self, wait: bool = True) -> None:
        self._server.close()

    # ------------------------------------------------------------------ server side
    def _handle(self, method: str, meta: dict, tensors: dict):
        step = meta.get("step")
        if method != "state" or type(step) is not int:
            raise ValueError("the state server answers only {'step': int} requests for 'state'")
        with self._cond:
            ok = self._cond.wait_for(lambda: self._allowed and self._step == step, timeout=self._timeout_s)
            if not ok:
                raise NotServing(f"serving step {self._step if self._allowed else 'none'}, asked for {step}")
            if self._error is not None:
                raise StateFormatError(self._error)  # (the joiner sees RemoteError; this replica goes on)
            self._readers += 1
            skeleton, out = self._skeleton, self._tensors
        self.served += 1
        return {"step": step, "skeleton": skeleton}, out, self._release

    def _release(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()
