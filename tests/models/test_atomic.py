"""Atomic writes: the permissions of a normal write, no user file ever replaced, no debris after a rerun."""

import os
import stat
import subprocess
import sys

import pytest

from eyas.models.atomic import atomic_file, atomic_folder
from eyas.models.errors import InputError


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_and_folders_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "out") as tmp:
            (tmp / "a.txt").write_text("x")
        with atomic_file(tmp_path / "b.txt") as f:
            f.write("y")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "out") == 0o755 and _mode(tmp_path / "out" / "a.txt") == 0o644
    assert _mode(tmp_path / "b.txt") == 0o644  # readable by another user (a serving container)


def test_a_folder_holding_other_files_is_never_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="notes.txt.*--force"):
        with atomic_folder(out, ours=("config.json",)) as tmp:
            (tmp / "config.json").write_text("{}")
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_folder(out, ours=("config.json",), force=True) as tmp:  # asked for
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    with atomic_folder(out, ours=("config.json",)) as tmp:  # what eyas wrote there may be replaced
        (tmp / "config.json").write_text("{}")


def test_a_file_in_the_way_is_refused_with_its_name(tmp_path):
    (tmp_path / "f").write_text("keep")
    with pytest.raises(InputError, match="not a folder"):
        with atomic_folder(tmp_path / "f"):
            pass
    with pytest.raises(InputError, match=f"{tmp_path / 'f'} is a file"):
        with atomic_file(tmp_path / "f" / "deeper" / "x.json") as f:
            f.write("{}")
    assert (tmp_path / "f").read_text() == "keep"


def test_debris_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    code = ("import os, sys; from eyas.models.atomic import atomic_file, atomic_folder\n"
            f"f = atomic_file({str(tmp_path / 'x.json')!r}); f.__enter__().write('half')\n"
            f"d = atomic_folder({str(tmp_path / 'h')!r}); t = d.__enter__(); (t / 'w').write_text('half')\n"
            "os._exit(9)  # killed mid-write: no cleanup runs")
    subprocess.run([sys.executable, "-c", code])
    assert len(list(tmp_path.iterdir())) == 2  # the two temporaries
    with atomic_file(tmp_path / "x.json") as f:
        f.write("{}")
    with atomic_folder(tmp_path / "h") as tmp:
        (tmp / "w").write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h", "x.json"]
