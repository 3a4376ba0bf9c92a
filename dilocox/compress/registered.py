"""Every codec module that registers a codec (``compress/codec.py``'s ``register``): ``compressor.selected`` looks
them up here, so a new codec is listed here once."""

from dilocox.compress import sign as sign
from dilocox.compress import sparse as sparse
from dilocox.compress.codec import REGISTRY as REGISTRY
