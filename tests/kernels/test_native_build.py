"""The native extension's build: it builds wherever a C++ compiler is (a kernel that does not compile must fail the
suite, not skip every native test); a lock left by a killed build must not hang later processes."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from llmserve.kernels import native


@pytest.mark.skipif(shutil.which("c++") is None or os.environ.get("LLMSERVE_NATIVE_OPTIONAL") == "1",
                    reason="no C++ compiler here (or LLMSERVE_NATIVE_OPTIONAL=1)")
def test_the_kernels_build_where_a_compiler_is() -> None:
    """Every native test skips where the extension is unavailable, which is right on a machine without a compiler and
    wrong where a source fails to compile: there the suite passed with the kernels' tests skipped (found when a
    refactor of packed_gemm.cpp did not compile and 1,000 tests went on passing or skipping)."""
    assert native.load() is not None, "the native CPU kernels did not build: see the 'native CPU kernels unavailable' log"


def _lock_kept(build_dir: Path, monkeypatch: pytest.MonkeyPatch, age_s: float, started: float | None = None,
               fresh_file: str | None = None) -> bool:
    """One check of the watcher over a lock age_s old in build_dir (and a fresh file beside it): whether it stayed."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(build_dir))
    lock = build_dir / "lock"
    lock.touch()
    made = time.time() - age_s
    os.utime(lock, (made, made))
    if fresh_file is not None:
        (build_dir / fresh_file).touch()
    done = threading.Event()
    done.set()  # one check, then return
    native._watch_build_lock(done, started=None if started is None else made + started)
    return lock.exists()


@pytest.mark.parametrize(("age_s", "removed"), [(native.STALE_LOCK_S + 60, True), (5, False)])
def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           age_s: float, removed: bool) -> None:
    assert _lock_kept(tmp_path, monkeypatch, age_s) is not removed


def test_a_lock_made_after_loading_started_is_never_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's own build: however long it takes, its lock stays (loading started 1 s before it was made)."""
    assert _lock_kept(tmp_path, monkeypatch, native.STALE_LOCK_S + 60, started=-1)


def test_a_lock_whose_build_is_still_writing_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's slow build (~5 minutes on a 2-core Xeon): its lock is old, but an object file is fresh."""
    assert _lock_kept(tmp_path, monkeypatch, native.STALE_LOCK_S + 60, fresh_file="qblock_gemm.o")


def test_load_times_its_start_before_the_build_can_make_its_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher's `started` is taken before cpp_load runs: taken in the thread, it could fall after the build's own
    lock was made, and a slow build then lost its lock (and failed) after STALE_LOCK_S."""
    import torch.utils.cpp_extension as cpp

    seen: dict[str, float] = {}
    watched = threading.Event()

    def watch(done: threading.Event, period_s: float = 5.0, started: float | None = None) -> None:
        seen["started"] = time.time() + 3600 if started is None else started
        watched.set()

    def fake_load(**kwargs: object) -> object:
        seen["build"] = time.time()
        return object()

    monkeypatch.setattr(native, "_watch_build_lock", watch)
    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", False)
    assert native.load() is not None
    assert watched.wait(10)
    assert seen["started"] <= seen["build"]


@pytest.mark.parametrize("slow", [True, False])
def test_a_long_build_is_announced_and_a_quick_load_is_not(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture, slow: bool) -> None:
    """A first start compiles for minutes (3 on a 2-core Zen 4): the log says so while it runs, and how long it took;
    a load from the cache says nothing."""
    import torch.utils.cpp_extension as cpp

    def fake_load(**kwargs: object) -> object:
        time.sleep(0.5 if slow else 0)
        return object()

    monkeypatch.setattr(native, "_watch_build_lock", lambda *args: None)
    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", False)
    monkeypatch.setattr(native, "BUILD_NOTICE_S", 0.1 if slow else 30.0)
    with caplog.at_level("INFO", logger=native.log.name):
        assert native.load() is not None
    messages = [r.getMessage() for r in caplog.records if r.name == native.log.name]
    if slow:
        assert any(m.startswith("building the native CPU kernels: once per machine") for m in messages), messages
        assert any(m.startswith("native CPU kernels ready after") for m in messages), messages
    else:
        assert messages == []
