"""dilocox's own networking, shared by the elastic replicas and the SWARM peers (issue 43 item 5).

secure (the run secret, the mutual handshake, ``AcceptGate``, ``dial``, signed values, the MAC / AEAD channel),
rpc (the tensor RPC with deadlines), mesh (collectives on authenticated pair connections), transfer (a joiner's
state transfer over the RPC, nothing unpickled), relay (TCP relays and guards that prove the secret; a standby
lighthouse), store (a ``TCPStore`` that listens on loopback only), tcp (TCP keepalive on the long-lived
connections). It imports nothing of ``dilocox.elastic``, ``dilocox.swarm``, ``dilocox.outer`` or ``dilocox.train``,
nor torchft (tests/test_layout.py): those build on it.
"""
