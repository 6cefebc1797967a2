"""ServerConfig: the fsync mode and the WAL writer are enums; the strings the command line
passes are accepted and turned into them, anything else is refused naming the field."""

from __future__ import annotations

import pytest

from fastlock.server import FsyncMode, ServerConfig, WalWriter


def test_strings_become_enum_members_and_compare_equal_to_them():
    config = ServerConfig(fsync="interval", wal_writer="inline")
    assert config.fsync is FsyncMode.INTERVAL and config.wal_writer is WalWriter.INLINE
    assert config.fsync == "interval" and config.fsync.value == "interval"
    assert ServerConfig().fsync is FsyncMode.ALWAYS and ServerConfig().wal_writer is WalWriter.AUTO
    assert ServerConfig(fsync=FsyncMode.NEVER).fsync is FsyncMode.NEVER


@pytest.mark.parametrize("field, value", [("fsync", "sometimes"), ("fsync", None), ("wal_writer", "process"),
                                          ("wal_writer", 1)])
def test_an_unknown_mode_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be one of"):
        ServerConfig(**{field: value})
