"""Atomic writes: a crash mid-write leaves the old file/folder or nothing, never half of one, and never debris.

- Written files and folders get the permissions any other tool would give them (0666 / 0777 less the umask),
  not the 0600 / 0700 of temporary files: an exported head must be readable by a serving container's user.
- A folder is replaced only when everything in it is what eyas writes there (`ours`), or with force: a user's
  own files are never removed, and a regular file where a folder should go is refused.
- Temporary siblings carry their writer's process id; a later write to the same path removes the ones whose
  writer is gone (killed mid-write), so an interrupted run leaves nothing behind once it is rerun.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Collection, Iterator

from .errors import InputError

_TMP, _OLD = ".eyas-tmp-", ".eyas-old-"


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask can only be read by setting it)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _chmod_tree(path: Path) -> None:
    """Give a finished temporary file or folder (and everything in it) the permissions of a normal write."""
    mask = _umask()
    if path.is_dir():
        for root, _, files in os.walk(path):
            os.chmod(root, 0o777 & ~mask)
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_debris(final: Path) -> None:
    """Remove the temporary siblings of `final` left by writers that died before finishing."""
    if not final.parent.is_dir():
        return
    for marker in (_TMP, _OLD):
        for stale in final.parent.glob(f".{final.name}{marker}*"):
            pid = stale.name[len(f".{final.name}{marker}"):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()


def make_parents(path: Path) -> None:
    """Create the folders above `path`, or say which part of the path is in the way."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), path.parent)
        raise InputError(f"cannot write {path}: {blocker} is a file, not a folder; choose another path") from None


def make_folder(path: str | os.PathLike) -> Path:
    """Create the folder `path` (and those above it), or say which part of the path is a file."""
    path = Path(path)
    make_parents(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path} is a file, not a folder; choose another path")
    path.mkdir(exist_ok=True)
    return path


def writable_file(path: str | os.PathLike) -> Path:
    """A file path whose folders exist (created here), or say what is in the way."""
    path = Path(path)
    make_parents(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder; give a file path")
    return path


def _check_replaceable(final: Path, ours: Collection[str] | None, force: bool) -> None:
    if not final.exists() and not final.is_symlink():
        return
    if not final.is_dir():
        raise InputError(f"{final} exists and is not a folder; choose another output path")
    if force or ours is None:
        return
    foreign = sorted(p.name for p in final.iterdir() if p.name not in ours)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise InputError(f"{final} already holds files eyas did not write there ({shown}); choose another output "
                         "folder, or pass --force to replace it")


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, ours: Collection[str] | None = (), force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `path` in (almost) one rename.

    An existing `path` may be replaced only if it holds nothing but entries named in `ours` (what eyas writes
    there; None: a folder eyas owns whole, like a cache) or `force` is set. It is first renamed aside and
    removed only after the new folder is in place, so at every instant the old or the new complete folder exists.
    """
    final = Path(path)
    make_parents(final)
    _check_replaceable(final, ours, force)
    clean_debris(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP}{os.getpid()}-", dir=final.parent))
    try:
        yield tmp
        _chmod_tree(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}{_OLD}{os.getpid()}-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator:
    """Open a temporary sibling for writing; rename it over `path` only when the block succeeds."""
    final = writable_file(path)
    clean_debris(final)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}{_TMP}{os.getpid()}-", dir=final.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _chmod_tree(Path(tmp))
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
