"""The event loop thread's scheduler slice (``coserve/server/thread_slice.py``)."""

from __future__ import annotations

import threading

import pytest

from coserve.server.thread_slice import MAX_SLICE_S, MIN_SLICE_S, restore_thread_slice, set_thread_slice, thread_slice_s


def _in_thread(fn):
    """``fn()`` on a fresh thread (a slice is per thread: the test's own is left alone); its value or its error."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_threads_slice_is_set_kept_to_that_thread_and_restored():
    if thread_slice_s() is None or _in_thread(lambda: set_thread_slice(MIN_SLICE_S)) is None:
        pytest.skip("this kernel has no per-thread slice for the fair class (Linux 6.12+)")

    def change():
        before = thread_slice_s()
        previous = set_thread_slice(0.0002)
        during = thread_slice_s()
        restore_thread_slice(previous)
        return before, previous, during, thread_slice_s()

    mine = thread_slice_s()
    before, previous, during, after = _in_thread(change)
    assert previous == pytest.approx(before) and during == pytest.approx(0.0002) and after == pytest.approx(before)
    assert thread_slice_s() == mine  # another thread's change is not this one's


def test_a_slice_outside_what_the_kernel_accepts_is_refused_by_name():
    for bad in (MIN_SLICE_S / 2, MAX_SLICE_S * 2, 0.0):
        with pytest.raises(ValueError, match="scheduler slice must be 0.1-100 ms"):
            set_thread_slice(bad)
    restore_thread_slice(None)  # nothing to undo: no error
