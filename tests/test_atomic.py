"""write_atomic: the one way autofit replaces a file."""
import os

import pytest
import torch

from autofit.atomic import write_atomic


def test_text_bytes_and_a_writer_function(tmp_path):
    assert write_atomic(tmp_path / "a" / "plan.json", "héllo\n").read_text(encoding="utf-8") == "héllo\n"
    assert write_atomic(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    write_atomic(tmp_path / "c.pt", lambda file: torch.save({"x": torch.arange(3)}, file))
    assert torch.equal(torch.load(tmp_path / "c.pt")["x"], torch.arange(3))


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = write_atomic(tmp_path / "last.pt", "old")

    def fails(file):
        file.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, fails)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["last.pt"]


def test_permissions_follow_the_umask_as_a_plain_write(tmp_path):
    previous = os.umask(0o027)
    try:
        path = write_atomic(tmp_path / "plan.json", "{}")
        (tmp_path / "plain").write_text("{}")
    finally:
        os.umask(previous)
    assert os.stat(path).st_mode & 0o777 == os.stat(tmp_path / "plain").st_mode & 0o777 == 0o640
