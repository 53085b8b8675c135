"""The KV index's holder table in C (deployments/cluster/csrc/holder_table.c, built on first
use) against its Python twin (holders.DictHolders) on random histories: adds and discards
over hundreds of keys (sha256-sized, shorter, and longer than the slots hold inline), masks
past 64 and 128 replicas, churn that leaves deleted slots behind; and the fallback where no
compiler is."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from deployments.cluster import holders, native
from deployments.cluster.holders import DictHolders
from deployments.cluster.prefix_index import PrefixIndex


def c_table() -> holders.Holders:
    return native.load("holder_table").HolderTable()  # type: ignore[no-any-return]


def random_key(rng: random.Random) -> bytes:
    size = rng.choice([1, 8, 32, 32, 32, 33, 64])
    return hashlib.sha256(rng.randbytes(8)).digest()[:size].ljust(size, b"k")


@pytest.mark.parametrize("seed", range(40))
def test_the_c_table_answers_as_the_python_one(seed: int) -> None:
    rng = random.Random(seed)
    c, py = c_table(), DictHolders()
    keys = [random_key(rng) for _ in range(rng.randint(1, 400))]
    replicas = rng.choice([3, 64, 65, 128, 200])
    for _ in range(rng.randint(1, 4000)):
        key, bit = rng.choice(keys), rng.randrange(replicas)
        change = "add" if rng.random() < 0.55 else "discard"
        getattr(c, change)(key, bit)
        getattr(py, change)(key, bit)
    assert [c.get(k) for k in keys] == [py.get(k) for k in keys]
    assert (len(c), c.num_entries()) == (len(py), py.num_entries())
    chain = keys[: rng.randint(0, len(keys))]
    assert c.match(chain) == py.match(chain)
    for _ in range(30):
        prompt = [rng.choice(keys) for _ in range(rng.randint(0, 60))]
        assert c.match(prompt) == py.match(prompt)


def test_the_c_table_keeps_growing_and_emptying() -> None:
    """Many keys (the table doubles past half full), then every one discarded (deleted slots
    that later adds reuse), then added again: nothing left behind, nothing lost."""
    c = c_table()
    keys = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(20_000)]
    for i, key in enumerate(keys):
        c.add(key, i % 130)
    assert len(c) == c.num_entries() == len(keys)
    for i, key in enumerate(keys):
        c.discard(key, i % 130)
    assert len(c) == c.num_entries() == 0 and c.match(keys[:5]) == []
    for key in keys[:1000]:
        c.add(key, 3)
    assert c.match(keys[:1000]) == [(1000, 1 << 3)] and len(c) == 1000


def test_the_c_table_refuses_what_is_not_a_block_hash() -> None:
    c = c_table()
    with pytest.raises(TypeError):
        c.add("not bytes", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.add(b"x", -1)
    with pytest.raises(TypeError):
        c.match(None)  # type: ignore[arg-type]

    class Hash(bytes):  # its __hash__ could run Python code in the middle of a walk
        pass

    with pytest.raises(TypeError):
        c.add(Hash(b"x"), 1)
    c.add(b"x", 1)
    with pytest.raises(TypeError):
        c.match([Hash(b"x")])


def test_the_index_runs_on_the_c_table_here() -> None:
    assert type(PrefixIndex()._holders).__name__ == "HolderTable"


def test_without_a_compiler_the_index_runs_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that cannot happen raises NativeBuildError (the index then takes the Python
    table, and says so once); PDSERVE_NATIVE=0 turns the C code off."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    build = native.load.__wrapped__  # not the cached module
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    with pytest.raises(native.NativeBuildError, match="did not compile"):
        build("holder_table")
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(native.NativeBuildError, match="no C compiler"):
        build("holder_table")
    monkeypatch.delenv("CC")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "a-file"))  # no cache to write
    with pytest.raises(native.NativeBuildError, match="cannot build"):
        build("holder_table")
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    with pytest.raises(native.NativeBuildError):
        build("holder_table")
    monkeypatch.setattr(holders, "_native_table", lambda: None)
    assert isinstance(holders.holders(), DictHolders)
