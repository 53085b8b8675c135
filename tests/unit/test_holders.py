"""The KV index's holder table in C (deployments/cluster/csrc/holder_table.c, built on first
use) against its Python twin (holders.DictHolders) on random histories: adds and discards
over hundreds of keys (sha256-sized, shorter, and longer than the slots hold inline), masks
past 64 and 128 replicas, churn that leaves deleted slots behind; and the fallback where no
compiler is. And the C table's layout: a walk over keys stored in the order walked reads the
entry after the previous one (no probe), through holes, compaction and wider masks; and its
memory is what tracemalloc counts (`bench index` reports it)."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from deployments.cluster import holders, native
from deployments.cluster.holders import DictHolders
from deployments.cluster.prefix_index import PrefixIndex


def c_table() -> holders.Holders:
    return native.load("holder_table").HolderTable()  # type: ignore[no-any-return]


def chain(start: int, count: int) -> list[bytes]:
    return [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(start, start + count)]


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
    keys = chain(0, 20_000)
    for i, key in enumerate(keys):
        c.add(key, i % 130)
    assert len(c) == c.num_entries() == len(keys)
    for i, key in enumerate(keys):
        c.discard(key, i % 130)
    assert len(c) == c.num_entries() == 0 and c.match(keys[:5]) == []
    for key in keys[:1000]:
        c.add(key, 3)
    assert c.match(keys[:1000]) == [(1000, 1 << 3)] and len(c) == 1000


def walk(table: holders.Holders, hashes: list[bytes]) -> tuple[list[tuple[int, int]], int]:
    """The table's answer, and how many of the walk's blocks took a probe of its index."""
    before = table.walk_counts()[1]  # type: ignore[attr-defined]
    found = table.match(hashes)
    return found, table.walk_counts()[1] - before  # type: ignore[attr-defined]


def test_a_walk_follows_keys_stored_in_its_order() -> None:
    """Stored one prompt after another, a walk probes its first block only; one that crosses
    to keys stored later probes where it crosses; holes, a compaction (the arena full) and
    masks widened past 64 replicas keep the order."""
    c, py = c_table(), DictHolders()
    first, second = chain(0, 300), chain(300, 200)
    for table in (c, py):
        for key in first + second:
            table.add(key, 1)
    assert walk(c, first) == ([(300, 2)], 1)
    assert walk(c, first[:100] + second[:50]) == (py.match(first[:100] + second[:50]), 2)
    for key in first[100:]:  # holes: the prompt's tail evicted
        for table in (c, py):
            table.discard(key, 1)
    churn = chain(1000, 2000)  # the arena fills up: compacted (or doubled) in order
    for key in churn:
        for table in (c, py):
            table.add(key, 70)  # past one mask word: every entry widens
    assert walk(c, first[:100]) == ([(100, 2)], 1)
    assert walk(c, second) == ([(200, 2)], 1)
    assert walk(c, churn) == (py.match(churn), 1)
    assert walk(c, churn[::-1])[1] == 2000  # against the order: every block probed
    assert c.match(churn[::-1]) == py.match(churn[::-1])


def test_the_c_tables_memory_is_counted_by_tracemalloc() -> None:
    keys = chain(0, 50_000)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        c = c_table()
        for key in keys:
            c.add(key, 3)
        size = tracemalloc.get_traced_memory()[0] - before
        del c
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 64 * len(keys) <= size <= 256 * len(keys)  # an entry, its share of the index
    assert after - before < size / 100  # freed with the table


# posix_memalign failing once, after `fail_after` calls pass (the table takes its arena and its
# index from it): LD_PRELOADed into a child process.
FAILING_ALLOC = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
int fail_after = -1;
int posix_memalign(void **p, size_t align, size_t size) {
    static int (*real)(void **, size_t, size_t);
    if (!real) real = dlsym(RTLD_NEXT, "posix_memalign");
    if (fail_after == 0) { fail_after = -1; return ENOMEM; }
    if (fail_after > 0) fail_after--;
    return real(p, align, size);
}
"""

RELAYOUT_OUT_OF_MEMORY = """
import ctypes
from deployments.cluster.native import load
table = load("holder_table").HolderTable()
keys = [bytes([i]) * 32 for i in range(64)]
for key in keys:
    table.add(key, 0)
for key in keys[:40]:  # 40 holes: the next key compacts the full arena
    table.discard(key, 0)
ctypes.c_int.in_dll(ctypes.CDLL(None), "fail_after").value = 1  # the arena, not the index
try:
    table.add(b"n" * 32, 0)
except MemoryError:
    print("MemoryError")
print(len(table), table.get(keys[50]), table.match(keys[40:]))
table.add(keys[50], 1)
for i in range(200):  # relayouts again
    table.add(i.to_bytes(32, "little"), 0)
print(len(table), table.get(keys[50]))
"""


def test_a_relayout_out_of_memory_leaves_the_table_as_it_was(tmp_path: Path) -> None:
    """Where the compacted arena's index cannot be had, the add raises MemoryError and the
    table answers as before (an arena compacted under the old index lost its keys, and the
    next relayout crashed)."""
    c_table()  # built (and cached) here first
    shim = tmp_path / "failing_alloc.so"
    source = tmp_path / "failing_alloc.c"
    source.write_text(FAILING_ALLOC)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(shim), "-ldl"], check=True)
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    script = textwrap.dedent(RELAYOUT_OUT_OF_MEMORY)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["MemoryError", "24 1 [(24, 1)]", "224 3"]


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
