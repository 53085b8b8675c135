"""The weights fingerprint in the KV compatibility hash (engine/models/fingerprint.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from engine.models.default_model import make_default_model
from engine.models.fingerprint import dummy_weights_fingerprint, weights_fingerprint


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


def test_dummy_weights_match_only_where_device_type_and_tp_size_do(tmp_path):
    """load_format=dummy draws its weights per device type and per rank's slice: the
    connector's fingerprint tells such engines apart (a config.json is all they read)."""
    from dataclasses import replace

    from connector.pd_connector import _weights_fingerprint
    from engine.arg_utils import EngineArgs
    from engine.testing.shaped_checkpoint import shaped_config_dir

    path = str(shaped_config_dir("smollm2-135m", tmp_path / "shape"))
    base = dummy_weights_fingerprint(path, "cpu", 1)
    assert dummy_weights_fingerprint(path, "cpu", 1) == base
    assert dummy_weights_fingerprint(path, "cuda", 1) != base
    assert dummy_weights_fingerprint(path, "cpu", 2) != base
    config, _ = EngineArgs(model=path, load_format="dummy", device="cpu").create_engine_config()
    assert _weights_fingerprint(config) == base
    checkpoint = make_default_model(str(tmp_path / "real"), seed=1)
    auto = replace(config, model=replace(config.model, model=checkpoint, load_format="auto"))
    assert _weights_fingerprint(auto) == weights_fingerprint(checkpoint)


def test_the_downloaded_revision_is_part_of_the_fingerprint(tmp_path):
    """Prefill and decode pods that fetched different Hub revisions never exchange KV, even
    where the sampled bytes could not tell them apart."""
    from engine.models.catalog import DOWNLOAD_MARKER

    first = make_default_model(str(tmp_path / "a"), seed=1)
    bare = weights_fingerprint(first)
    marker = Path(first) / DOWNLOAD_MARKER
    marker.write_text(json.dumps({"model": "org/m", "revision": "1" * 40}))
    pinned = weights_fingerprint(first)
    marker.write_text(json.dumps({"model": "org/m", "revision": "2" * 40}))
    assert len({bare, pinned, weights_fingerprint(first)}) == 3
