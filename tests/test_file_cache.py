"""``FileCache`` (fastdecode/files/file_cache.py): an object loaded from files is kept while the files keep their
identity (path, size, mtime_ns), loaded again once one is rewritten; per owner, weakly; the newest ``maxsize``."""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from fastdecode.files.file_cache import FileCache, file_identity


def _write(path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))  # explicit: a coarse clock could give a rewrite the same mtime


def test_a_rewritten_file_is_loaded_again(tmp_path):
    path, loads = tmp_path / "f.txt", []
    cache = FileCache()

    def load():
        loads.append(path.read_text())
        return object()

    _write(path, "one", 1_000_000_000)
    first = cache.get([path], load)
    assert cache.get([str(path)], load) is first and loads == ["one"]  # same file: no second load
    _write(path, "two", 2_000_000_000)  # same size, newer
    second = cache.get([path], load)
    assert second is not first and loads == ["one", "two"]
    _write(path, "three", 2_000_000_000)  # same mtime, another size
    assert cache.get([path], load) is not second and loads[-1] == "three"
    assert len(cache) == 1  # the stale version was replaced, not kept beside the new one


def test_every_file_of_an_entry_counts_and_a_missing_one_fails(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "a", 1_000_000_000)
    _write(b, "b", 1_000_000_000)
    cache, calls = FileCache(), []
    first = cache.get([a, b], lambda: calls.append(1) or object())
    _write(b, "bb", 1_000_000_000)
    assert cache.get([a, b], lambda: calls.append(1) or object()) is not first and len(calls) == 2
    b.unlink()
    with pytest.raises(OSError):
        cache.get([a, b], object)
    assert file_identity([a])[0][1:] == (1, 1_000_000_000)


def test_keys_owners_and_size(tmp_path):
    path = tmp_path / "f"
    _write(path, "x", 1_000_000_000)
    cache = FileCache(maxsize=1)
    cpu = cache.get([path], object, key="cpu")
    assert cache.get([path], object, key="cuda") is not cpu  # another key: loaded for it
    assert cache.get([path], object, key="cpu") is not cpu  # maxsize=1: the cuda entry pushed cpu out

    class Owner:
        pass

    cache.clear()
    one, two = Owner(), Owner()
    mine = cache.get([path], object, owner=one)
    assert cache.get([path], object, owner=two) is not mine and cache.get([path], object, owner=one) is mine
    assert len(cache) == 2  # maxsize is per owner
    gone = weakref.ref(one)
    del one
    gc.collect()
    assert gone() is None and len(cache) == 1  # the cache kept no owner alive; its entries went with it
    with pytest.raises(ValueError, match="maxsize"):
        FileCache(maxsize=0)
