"""A full disk while `autofit export` writes is one line, and an earlier export stays whole (#53)."""
import pytest
import torch

from autofit.errors import UserError
from autofit.tools.export import save_model


def test_a_full_disk_under_the_torchscript_writer_is_one_line_and_keeps_the_earlier_file(tmp_path, monkeypatch):
    path = tmp_path / "best-export.pt"
    path.write_bytes(b"an earlier export")

    def full(module, file, **kwargs):
        file.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch.jit, "save", full)
    with pytest.raises(UserError, match=r"the disk holding .* is full \(No space left on device\) writing best-export.pt; free space"):
        save_model(torch.nn.Linear(3, 2), torch.randn(2, 3), path, file_format="torchscript")
    assert path.read_bytes() == b"an earlier export" and sorted(p.name for p in tmp_path.iterdir()) == ["best-export.pt"]
