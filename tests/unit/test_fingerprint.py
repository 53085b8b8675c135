"""The weights fingerprint in the KV compatibility hash (engine/models/fingerprint.py)."""

from __future__ import annotations

import os
import shutil

from engine.models.default_model import make_default_model
from engine.models.fingerprint import weights_fingerprint


def test_same_files_anywhere_match_and_any_changed_weights_do_not(tmp_path):
    first = make_default_model(str(tmp_path / "a"), seed=1)
    copy = shutil.copytree(first, tmp_path / "copy")
    other = make_default_model(str(tmp_path / "b"), seed=2)  # same architecture
    assert weights_fingerprint(str(copy)) == weights_fingerprint(first)
    assert weights_fingerprint(other) != weights_fingerprint(first)


def test_a_file_changed_in_place_is_read_again(tmp_path):
    path = tmp_path / "model.gguf"
    data = bytearray(os.urandom(3 << 20))
    path.write_bytes(data)
    before = weights_fingerprint(str(path))
    data[len(data) - 100] ^= 1  # in the last sample: a changed tail
    path.write_bytes(data)
    os.utime(path, ns=(1, 1))  # whatever the clock: the mtime moved
    assert weights_fingerprint(str(path)) != before
