"""Files named by the environment, read as untrusted (whichdevice.core.untrusted): regular files only,
capped in size and time, each refusal naming the path and what it is."""

from __future__ import annotations

import os
import socket

import pytest

from whichdevice.core.untrusted import UntrustedFileError, read_untrusted


def test_a_regular_file_is_read_whole(tmp_path):
    path = tmp_path / "c.json"
    path.write_bytes(b'{"a": 1}')
    assert read_untrusted(path, 100) == b'{"a": 1}'
    with pytest.raises(FileNotFoundError):
        read_untrusted(tmp_path / "none.json", 100)


def test_a_file_over_its_cap_is_refused_by_the_size_of_the_open_descriptor(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 101)
    with pytest.raises(UntrustedFileError, match="101 bytes, over the 100"):
        read_untrusted(path, 100)


@pytest.mark.parametrize(("make", "kind"), [
    (lambda p: os.mkfifo(p), "a named pipe"),
    (lambda p: p.mkdir(), "a folder"),
])  # fmt: skip
def test_a_fifo_or_a_folder_is_said_not_read(tmp_path, make, kind):
    path = tmp_path / "x"
    make(path)
    with pytest.raises(UntrustedFileError, match=kind):
        read_untrusted(path, 100)


def test_a_socket_and_a_device_are_said_not_read(tmp_path):
    with pytest.raises(UntrustedFileError, match="a character device"):
        read_untrusted("/dev/zero", 100)
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(UntrustedFileError, match="a socket"):
            read_untrusted(path, 100)


def test_a_read_past_its_time_is_given_up(tmp_path):
    path = tmp_path / "slow.json"
    path.write_bytes(b"x" * (1 << 18))  # several chunks: the deadline is checked between them
    with pytest.raises(UntrustedFileError, match="took over"):
        read_untrusted(path, 1 << 20, max_seconds=-1)


def test_a_path_with_control_characters_is_said_escaped(tmp_path):
    path = tmp_path / "a\x1b[31mb"
    path.mkdir()
    with pytest.raises(UntrustedFileError) as caught:
        read_untrusted(path, 100)
    assert "\x1b" not in str(caught.value) and "\\x1b" in str(caught.value)
