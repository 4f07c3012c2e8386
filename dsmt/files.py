"""Writing folders so that a reader never sees a half-written one, and a verb never replaces what it did not write."""

import os
import re
import shutil
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsmt import DsmtError


@dataclass(frozen=True)
class Product:
    """A kind of folder a verb writes: ``what`` it is, in words, and ``entries(folder)``: the names such a verb
    wrote in an existing folder, read from its marker files (None: the folder is not one of these)."""
    what: str
    entries: Callable[[Path], set[str] | None]


def check_replaceable(target: Path, product: Product | None, flag: str) -> None:
    """``target`` may be written if it is absent or an empty folder, and replaced only if it is ``product``
    holding nothing but what the verb wrote there; anything else is refused, never moved or deleted."""
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink():
        names = {p.name for p in target.iterdir()}
        if not names:
            return
        own = product.entries(target) if product else None
        if own is not None:
            foreign = sorted(names - own)
            if not foreign:
                return
            raise DsmtError(f"{flag} {target} is {product.what} but also holds {foreign[0]!r}, which dsmt did not "
                            f"write there; move that away or choose another {flag}")
    what = product.what if product else "a folder dsmt may create"
    raise DsmtError(f"{flag} {target} exists and is not {what}; dsmt replaces only what it wrote itself: choose "
                    f"another {flag} (or remove {target} yourself)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_staging(target: Path, host: str) -> None:
    """Staging and replaced folders that an interrupted run of this host left beside ``target``."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(tmp|old)-{re.escape(host)}-(\d+)$")
    for sibling in target.parent.iterdir():
        match = pattern.match(sibling.name)
        if match and not _alive(int(match.group(2))):
            shutil.rmtree(sibling, ignore_errors=True)


@contextmanager
def staged_dir(target: Path, product: Product | None, flag: str = "--out"):
    """Yield a fresh staging folder beside ``target``. On success it is renamed to ``target``; an older
    ``target`` (which ``check_replaceable`` allows) is removed only once the new one is in place. On failure
    the staging folder is removed; those of dead processes on this host are removed on the next run."""
    check_replaceable(target, product, flag)
    target.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    _remove_stale_staging(target, host)
    suffix = f"{host}-{os.getpid()}"
    staging = target.with_name(f".{target.name}.tmp-{suffix}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        old = target.with_name(f".{target.name}.old-{suffix}")
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_input_file(path: str, flag: str) -> None:
    """A text file to read (``-``: standard input), checked before any model is loaded."""
    if path == "-":
        return
    if Path(path).is_dir():
        raise DsmtError(f"{flag} {path} is a folder; give a text file")
    if not Path(path).is_file():
        raise DsmtError(f"{flag} {path} not found")


def check_output_file(path: str | None, flag: str) -> None:
    """A file to write (``-``: standard output), checked before any work: its folder exists and is writable."""
    if path is None or path == "-":
        return
    file = Path(path)
    if file.is_dir():
        raise DsmtError(f"{flag} {path} is a folder; give a file name")
    if not file.parent.is_dir():
        raise DsmtError(f"{flag} {path}: the folder {file.parent} does not exist; create it first")
    if not os.access(file.parent, os.W_OK) or file.exists() and not os.access(file, os.W_OK):
        raise DsmtError(f"{flag} {path} cannot be written (read-only); choose another path")
