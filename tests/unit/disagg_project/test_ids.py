"""Ids drawn without a syscall each: uuid4-shaped, unique, and not repeated by a forked child."""

from __future__ import annotations

import os

from disagg_project.ids import new_id


def test_ids_are_32_hex_digits_and_unique() -> None:
    ids = {new_id() for _ in range(100_000)}
    assert len(ids) == 100_000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in list(ids)[:100])


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    child_id = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    assert child_id != new_id()
