"""Writing folders so that a reader never sees a half-written one."""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_dir(target: Path):
    """Yield a fresh staging folder beside ``target``. On success it is renamed to ``target``; an older
    ``target`` is removed only once the new one is in place. On failure the staging folder is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
