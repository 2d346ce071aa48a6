"""Every text reader guarded (#53): encodings, non-regular files and corrupt parquet are one line naming the file and
the way out, never a traceback or a wait."""
import json
import os
import threading

import pytest

from autofit.errors import UserError
from autofit.training.text import read_documents


def test_utf8_with_or_without_a_byte_order_mark_reads_and_other_encodings_are_one_line(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "caf\u00e9"}).encode() + b"\n")
    assert read_documents(bom) == [{"text": "caf\u00e9"}]
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(UserError, match=r"'.*latin.txt' is not UTF-8 \(byte 0xe9 at offset 3\); convert it, e.g. `iconv"):
        read_documents(latin)


def test_a_folder_or_a_pipe_with_a_text_suffix_is_one_line_and_never_waits(tmp_path):
    (tmp_path / "corpus.txt").mkdir()
    with pytest.raises(UserError, match="is a folder, not a .txt file"):
        read_documents(tmp_path / "corpus.txt")
    fifo = tmp_path / "corpus.jsonl"
    os.mkfifo(fifo)
    raised = []

    def read():
        try:
            read_documents(fifo)
        except UserError as error:
            raised.append(str(error))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # blocked in open(): let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=5)
        pytest.fail("reading a FIFO blocked in open()")
    assert raised and "is not a regular file (a pipe, socket or device)" in raised[0]


@pytest.mark.parametrize("content", [b"not parquet at all", b"PAR1\x00\x01\x02"])
def test_a_corrupt_or_truncated_parquet_is_one_line(tmp_path, content, capfd):
    pytest.importorskip("datasets")
    path = tmp_path / "corpus.parquet"
    path.write_bytes(content)
    with pytest.raises(UserError, match=r"'.*corpus.parquet' cannot be read as parquet \(.*\); is it truncated"):
        read_documents(path)
    assert capfd.readouterr().err == ""  # datasets' own "Failed to read schema ..." is not printed above the line
