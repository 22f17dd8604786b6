"""The native extension's build: a lock left by a killed build must not hang later processes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from llmserve.kernels import native


@pytest.mark.parametrize(("age_s", "removed"), [(native.STALE_LOCK_S + 60, True), (5, False)])
def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           age_s: float, removed: bool) -> None:
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    lock.touch()
    past = time.time() - age_s
    os.utime(lock, (past, past))
    done = threading.Event()
    done.set()  # one check, then return
    native._watch_build_lock(done)
    assert lock.exists() is not removed


def test_a_lock_made_after_loading_started_is_never_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's own build: however long it takes, its lock stays."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    lock.touch()
    made = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (made, made))
    done = threading.Event()
    done.set()
    native._watch_build_lock(done, started=made - 1)  # loading started before the lock was made
    assert lock.exists()
