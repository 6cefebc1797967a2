"""Hash slots: which of :data:`SLOTS` slots a lock, key or semaphore name falls in.

The rule is Redis Cluster's (its cluster specification, "Keys distribution model"
and "Hash tags"): the slot of a name is CRC16 (the XMODEM variant: polynomial
0x1021, initial value 0, as :func:`binascii.crc_hqx` computes it) of the name's
UTF-8 bytes, modulo 16384.  If the name holds a ``{``, a ``}`` after it, and at
least one character between the two, only the characters between the first ``{``
and the first ``}`` after it (the *hash tag*) are hashed: ``{user1000}.following``
and ``{user1000}.followers`` share a slot, so a multi-name request over them stays
on one shard.  ``foo{}{bar}`` has an empty first tag and hashes whole.
"""

from __future__ import annotations

from binascii import crc_hqx

__all__ = ["SLOTS", "slot_of", "hash_tag"]

#: the number of hash slots (Redis Cluster's 16384): slots are 0..SLOTS-1
SLOTS = 16384


def hash_tag(name: str) -> str | None:
    """The hash tag of ``name`` (the text between its first ``{`` and the first ``}``
    after it, if not empty), or None: the whole name is hashed."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:  # no closing brace, or an empty tag
        return None
    return name[start + 1:end]


def slot_of(name: str) -> int:
    """The slot (0..16383) of ``name``: CRC16-XMODEM of its hash tag, or of the whole
    name without one, modulo :data:`SLOTS`, as Redis Cluster's ``CLUSTER KEYSLOT``.

    :raises TypeError: ``name`` is not a str.
    """
    start = name.find("{")
    if start >= 0:
        end = name.find("}", start + 1)
        if end > start + 1:
            name = name[start + 1:end]
    return crc_hqx(name.encode("utf-8", "surrogatepass"), 0) & (SLOTS - 1)
