"""A thread's scheduler slice on Linux's EEVDF scheduler (kernel 6.12 and later): how long the kernel lets the
thread run before others with earlier deadlines, and how soon it can take a core when it wakes.

On a CPU whose cores the engine's compute threads keep busy, a thread that wakes (the event loop, when a request or
a token comes in) waits for one of them to reach the end of its slice: up to the kernel's base slice, 1.4 ms on the
2-core machines this was built on, at every wake-up. A thread that asks for a shorter slice gets an earlier deadline
and preempts a longer-sliced one when it wakes. ``sched_setattr``'s ``sched_runtime`` sets it for a normal
(``SCHED_OTHER``) thread, without privileges; the kernel keeps it within 0.1-100 ms. Python has no binding for the
call, so it is made through libc's ``syscall``.
"""

from __future__ import annotations

import ctypes
import platform
import struct

# (sched_setattr, sched_getattr) system call numbers
SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1: size, policy, flags, nice,
#   priority, runtime, deadline, period, util_min, util_max
_NORMAL_POLICIES = (0, 3)  # SCHED_OTHER, SCHED_BATCH: the fair class, where runtime is the slice
MIN_SLICE_S, MAX_SLICE_S = 0.0001, 0.1  # what the kernel accepts


def _syscalls() -> tuple[int, int] | None:
    if platform.system() != "Linux":
        return None
    return SYSCALLS.get(platform.machine())


def _get(libc, number: int) -> tuple | None:
    buf = ctypes.create_string_buffer(_ATTR.size)
    if libc.syscall(number, 0, buf, _ATTR.size, 0) != 0:
        return None
    return _ATTR.unpack(buf.raw)


def thread_slice_s() -> float | None:
    """The calling thread's slice in seconds; None where it cannot be read (not Linux on x86_64 or aarch64, or a
    kernel without ``sched_getattr``)."""
    calls = _syscalls()
    if calls is None:
        return None
    attr = _get(ctypes.CDLL(None, use_errno=True), calls[1])
    return None if attr is None else attr[5] / 1e9


def set_thread_slice(seconds: float) -> float | None:
    """Give the calling thread a slice of ``seconds`` (within [MIN_SLICE_S, MAX_SLICE_S]), keeping its policy and
    nice value; returns its previous slice, or None where nothing was changed (not Linux on x86_64 or aarch64, a
    real-time policy, or a kernel that refuses: before 6.12 the fair class has no per-thread slice)."""
    if not MIN_SLICE_S <= seconds <= MAX_SLICE_S:
        raise ValueError(f"a scheduler slice must be {MIN_SLICE_S * 1000:g}-{MAX_SLICE_S * 1000:g} ms, got "
                         f"{seconds * 1000:g} ms")
    calls = _syscalls()
    if calls is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _get(libc, calls[1])
    if attr is None or attr[1] not in _NORMAL_POLICIES:
        return None
    _, policy, _, nice, _, runtime, *_ = attr
    new = _ATTR.pack(_ATTR.size, policy, 0, nice, 0, round(seconds * 1e9), 0, 0, 0, 0)
    if libc.syscall(calls[0], 0, ctypes.create_string_buffer(new, _ATTR.size), 0) != 0:
        return None
    after = _get(libc, calls[1])
    if after is None or after[5] != round(seconds * 1e9):  # a kernel that ignores runtime for the fair class
        return None
    return runtime / 1e9


def restore_thread_slice(previous: float | None) -> None:
    """Undo ``set_thread_slice`` (given what it returned); nothing for None."""
    if previous is not None:
        set_thread_slice(min(max(previous, MIN_SLICE_S), MAX_SLICE_S))

