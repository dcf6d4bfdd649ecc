"""Data helpers: list reading, sharding, splitting, shuffle determinism and batching."""

import os

import pytest

from paddle_cluster.train import data as D


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _read(path):
    with open(path) as f:
        return f.read()


def test_file_list_relative_to_list_dir_glob_and_dir(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    for n in ("a.txt", "b.txt", "c.dat"):
        _write(tmp_path / "d" / n, n)
    _write(tmp_path / "train.list", f"d/b.txt\n\n# comment\n  d/a.txt  \n{tmp_path / 'd' / 'c.dat'}\n")
    monkeypatch.chdir("/")  # relative entries must not depend on the working directory
    got = D.file_list(str(tmp_path / "train.list"))
    assert got == [str(tmp_path / "d" / n) for n in ("b.txt", "a.txt", "c.dat")]
    assert all(os.path.isfile(p) for p in got)
    assert D.file_list(str(tmp_path / "d" / "*.txt")) == [str(tmp_path / "d" / n) for n in ("a.txt", "b.txt")]
    assert len(D.file_list(str(tmp_path / "d"))) == 3
    with pytest.raises(FileNotFoundError):
        D.file_list(str(tmp_path / "nothing-*.txt"))


def test_shard_partitions_round_robin():
    items = list(range(10))
    parts = [D.shard(items, i, 3) for i in range(3)]
    assert parts == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(sum(parts, [])) == items
    with pytest.raises(ValueError):
        D.shard(items, 3, 3)
    rd = [list(D.shard_reader(D.from_list(items), i, 3)()) for i in range(3)]
    assert rd == parts


@pytest.mark.parametrize("mode", ["round_robin", "contiguous"])
@pytest.mark.parametrize("n_lines", [0, 1, 7, 10])
def test_split_file(tmp_path, mode, n_lines):
    src = tmp_path / "all.txt"
    lines = [f"line{i}" for i in range(n_lines)]
    _write(src, "\n".join(lines))  # no trailing newline on the last line
    parts = D.split_file(str(src), 3, str(tmp_path / "out" / "part"), mode=mode)
    assert [os.path.basename(p) for p in parts] == ["part-00000", "part-00001", "part-00002"]
    texts = [_read(p) for p in parts]
    assert all(t.endswith("\n") or not t for t in texts)
    got = [t.splitlines() for t in texts]
    sizes = [len(g) for g in got]
    assert max(sizes) - min(sizes) <= 1
    if mode == "round_robin":
        assert got == [lines[k::3] for k in range(3)]
    else:
        assert sum(got, []) == lines
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp" in n]


def test_lines_reader_and_batch(tmp_path):
    _write(tmp_path / "a", "1\n2\n3\n")
    _write(tmp_path / "b", "4\n5\n")
    r = D.map_reader(int, D.lines_reader([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert list(r()) == [1, 2, 3, 4, 5]
    assert list(r()) == [1, 2, 3, 4, 5]  # a reader can be read again
    assert list(D.batch(r, 2)()) == [[1, 2], [3, 4], [5]]
    assert list(D.batch(r, 2, drop_last=True)()) == [[1, 2], [3, 4]]
    assert list(D.firstn(r, 2)()) == [1, 2]


def test_shuffle_is_seeded_buffered_and_complete():
    src = D.from_list(list(range(100)))
    a, b = D.shuffle(src, 10, seed=3), D.shuffle(src, 10, seed=3)
    a1, a2 = list(a()), list(a())
    assert a1 == list(b()) and a2 == list(b())  # same seed -> same sequence of passes
    assert a1 != a2  # but passes differ from each other
    assert list(a(pass_index=1)) == a2  # a pass can be replayed
    assert sorted(a1) == list(range(100))
    # Buffered: each block of 10 stays within its block.
    for k in range(10):
        assert sorted(a1[10 * k : 10 * k + 10]) == list(range(10 * k, 10 * k + 10))
    assert list(D.shuffle(src, 10, seed=4)()) != a1
    assert list(D.shuffle(src, 1000, seed=0)()) != list(range(100))
