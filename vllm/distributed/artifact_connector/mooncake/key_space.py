# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What makes two engines' artifact keys comparable, and the check that
every engine of one key space agrees on it.

A key is derived from a KV block hash (``request_core.KeySpace``), so two
engines share routes only if they hash blocks alike: the same model, the
same hash algorithm and seed (vLLM's ``NONE_HASH``, the root of every
chain, fingerprints both), the same block size and the same row format.
The terms also fingerprint the deployment secret (:func:`secret_id`).
The first engine of a key space records its :class:`KeySpaceTerms` in the
Mooncake Store (hard-pinned, so never evicted); every later one compares
and refuses to start on a difference, naming it.

The record is authenticated under the deployment secret (a MAC over the
key space's name and the terms), and its name is a keyed hash of the key
space under the secret: someone who reaches the master but lacks the
secret can neither plant it ahead of the engines nor alter it. A record
that fails authentication is treated as absent: removed and replaced, with
a warning. (Engines given different secrets therefore record separate
terms; their objects fail each other's MACs, counted as rejected.)"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.distributed.artifact_connector.mooncake.client import (
    OBJECT_NOT_FOUND,
    MooncakeUnavailableError,
)
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger
from vllm_host_transport.mooncake_probe import describe_error

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

_TERMS_NBYTES = 4096
_MAC_NBYTES = 32  # the record: MAC, then the terms' JSON
_FIXES = {
    "model": "serve the same model on every engine (--served-model-name gives "
    "one name to one model under different paths)",
    "hash_algo": "use the same --prefix-caching-hash-algo on every engine",
    "none_hash": "set the same PYTHONHASHSEED on every engine (it seeds the "
    "block hashes)",
    "block_size": "use the same --block-size on every engine",
    "row_format": "use the same routed_experts_dtype on every engine",
    "secret_id": "give every engine the same deployment secret "
    "(shared_secret_file, or $VLLM_ROUTED_EXPERTS_SECRET)",
}


def secret_id(secret: bytes) -> str:
    """A public fingerprint of the deployment secret (a hash of it under
    its own personalisation, so it reveals nothing the objects' MACs do
    not): engines with different secrets would remove each other's objects
    as forged, so they may not share a key space."""
    return hashlib.blake2b(secret, digest_size=8, person=b"vllm-r3-secret").hexdigest()


class KeySpaceMismatchError(ArtifactError, ValueError):
    """This engine does not hash blocks like the key space's other engines."""


class KeySpaceAuthenticationError(ArtifactError):
    """The key space's terms record fails authentication under this
    engine's secret and could not be replaced."""


def _terms_mac_key(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=32, person=b"vllm-r3-terms").digest()


def _terms_mac(secret: bytes, key_space: str, encoded: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_MAC_NBYTES, key=_terms_mac_key(secret))
    h.update(key_space.encode())
    h.update(b"\0")
    h.update(encoded)
    return h.digest()


@dataclasses.dataclass(frozen=True)
class KeySpaceTerms:
    """How an engine derives artifact keys (see the module docs)."""

    model: str
    hash_algo: str
    none_hash: str  # hex of vLLM's NONE_HASH for this algorithm and seed
    block_size: int
    row_format: str  # layers x top-k, dtype
    secret_id: str  # secret_id() of the deployment secret

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> KeySpaceTerms:
        from vllm.config.artifact import routed_experts_row_spec
        from vllm.config.artifact_transfer import shared_secret
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

        cache = vllm_config.cache_config
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        spec = routed_experts_row_spec(vllm_config)
        names = vllm_config.model_config.served_model_name
        return cls(
            model=str(names[0] if isinstance(names, list) else names),
            hash_algo=str(cache.prefix_caching_hash_algo),
            none_hash=bytes(hash_fn(resolve_none_hash_seed(hash_fn))).hex(),
            block_size=int(cache.block_size),
            row_format=f"{spec.row_shape[0]}x{spec.row_shape[1]} {spec.dtype}",
            secret_id=secret_id(shared_secret(vllm_config.artifact_config)),
        )

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()


def max_object_nbytes(vllm_config: VllmConfig) -> int:
    """The largest artifact object of this engine's key space: a full block
    of rows and its envelope (the terms fix both for every engine)."""
    from vllm.config.artifact import routed_experts_row_spec
    from vllm.distributed.artifact_connector.request_core import ENVELOPE_NBYTES

    spec = routed_experts_row_spec(vllm_config)
    return vllm_config.cache_config.block_size * spec.row_nbytes + ENVELOPE_NBYTES


def terms_key(key_space: str, secret: bytes) -> str:
    """The record's name: a keyed hash of the key space under the secret
    (nobody without the secret can name it ahead of the engines)."""
    h = hashlib.blake2b(key_space.encode(), digest_size=32, key=_terms_mac_key(secret))
    return "vllm-artifact-key-space/" + h.hexdigest()


def record(key_space: str, terms: KeySpaceTerms, secret: bytes) -> bytes:
    """The authenticated record of ``terms``: MAC, then the JSON."""
    encoded = terms.encode()
    return _terms_mac(secret, key_space, encoded) + encoded


def agree(
    client: Any, master: str, key_space: str, terms: KeySpaceTerms, secret: bytes
) -> None:
    """Record ``terms`` as the key space's, or check them against the ones
    recorded; raises :class:`KeySpaceMismatchError` naming each difference
    and its fix. A recorded record that fails authentication under
    ``secret`` is removed and replaced (:class:`KeySpaceAuthenticationError`
    when that does not stick)."""
    from mooncake.store import ReplicateConfig

    key = terms_key(key_space, secret)
    buf = np.zeros(_TERMS_NBYTES, np.uint8)
    ptr = buf.ctypes.data
    if client.register_buffer(ptr, buf.nbytes) != 0:
        raise MooncakeUnavailableError("Mooncake refused to register a buffer")
    forged = 0
    try:
        for _ in range(3):
            (rc,) = client.batch_get_into([key], [ptr], [buf.nbytes])
            if rc >= 0:
                got = bytes(buf[:rc])
                mac, encoded = got[:_MAC_NBYTES], got[_MAC_NBYTES:]
                if rc > _MAC_NBYTES and hmac.compare_digest(
                    mac, _terms_mac(secret, key_space, encoded)
                ):
                    return _compare(key_space, terms, encoded)
                # Not written by an engine of this secret: absent. Forced:
                # it is hard-pinned, and readers' leases must not keep it.
                forged += 1
                logger.warning(
                    "the terms record of artifact key space %r in the Mooncake "
                    "Store of master %s failed authentication (not written "
                    "under this deployment secret: planted or altered by "
                    "someone who reaches the master); it is removed and "
                    "replaced",
                    key_space,
                    master,
                )
                client.remove(key, True)
            elif rc != OBJECT_NOT_FOUND:
                break
            mine = record(key_space, terms, secret)
            buf[: len(mine)] = np.frombuffer(mine, np.uint8)
            pin = ReplicateConfig()
            pin.with_hard_pin = True
            # Two first engines may race: each reads back what stayed.
            client.batch_put_from([key], [ptr], [len(mine)], pin)
        if forged:
            raise KeySpaceAuthenticationError(
                f"the terms record of artifact key space {key_space!r} in the "
                f"Mooncake Store of master {master} failed authentication "
                f"{forged} times and could not be replaced: someone who "
                "reaches the master keeps writing it; restrict the master's "
                "network"
            )
        raise MooncakeUnavailableError(
            f"cannot record the terms of key space {key_space!r} in the Mooncake "
            f"Store of master {master}: {describe_error(rc)}. Where the master "
            "is up, the memory of another engine of the key space could not "
            "be reached: an engine on another host must set "
            "mooncake_local_hostname to its address on the engines' network "
            "(the default, 127.0.0.1, serves one host only)"
        )
    finally:
        client.unregister_buffer(ptr)


def _compare(key_space: str, terms: KeySpaceTerms, recorded: bytes) -> None:
    """``recorded``: authenticated terms (written by an engine of the same
    secret), so a difference is a real mismatch."""
    try:
        theirs = json.loads(recorded)
    except ValueError:
        theirs = {}
    mine = dataclasses.asdict(terms)
    diffs = [
        f"{name}: this engine {mine[name]!r}, the key space {theirs.get(name)!r} "
        f"({_FIXES[name]})"
        for name in mine
        if theirs.get(name) != mine[name]
    ]
    if diffs:
        raise KeySpaceMismatchError(
            f"--enable-routed-experts: this engine cannot join the artifact key "
            f"space {key_space!r}: it derives keys differently from the engine "
            f"that recorded the key space: {'; '.join(diffs)}. Or give this "
            "engine its own key_space in --artifact-config."
        )
