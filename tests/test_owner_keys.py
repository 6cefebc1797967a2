"""Owner keys (fastlock.client.owner_keys): fresh, never repeated, and a forked
child never hands out the keys its parent is about to hand out."""

from __future__ import annotations

import os

from fastlock.client.owner_keys import KEYS_PER_DRAW, OWNER_KEY_BYTES, new_owner_key


def test_keys_have_the_protocol_size_and_never_repeat_across_draws():
    keys = [new_owner_key() for _ in range(3 * KEYS_PER_DRAW + 5)]
    assert {len(k) for k in keys} == {OWNER_KEY_BYTES}
    assert len(set(keys)) == len(keys)


def keys_of_a_forked_child(draw, count: int = 20) -> set[bytes]:
    """The ``count`` owner keys a forked child of this process gets from ``draw()`` (each
    :data:`OWNER_KEY_BYTES` long), sent back through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its keys and leave at once
        try:
            os.close(read_end)
            os.write(write_end, b"".join(draw() for _ in range(count)))
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    try:
        while len(data) < count * OWNER_KEY_BYTES:
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    child = {data[i:i + OWNER_KEY_BYTES] for i in range(0, len(data), OWNER_KEY_BYTES)}
    assert len(child) == count
    return child


def test_a_forked_child_draws_keys_its_parent_never_draws():
    new_owner_key()  # the pool now holds KEYS_PER_DRAW - 1 keys the child inherits
    child = keys_of_a_forked_child(new_owner_key)
    parent = {new_owner_key() for _ in range(KEYS_PER_DRAW)}
    assert not child & parent
