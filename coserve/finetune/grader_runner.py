"""The python grader's own process (``python_grader.py`` runs this file as a script, ``python -I``): it reads its job
from stdin, shuts itself in where the kernel allows it, binds its limits, then runs the grader's source on each pair
and writes the outcomes as the last line of stdout.

Shut in, on Linux, before the grader's code runs:
- no network: a network namespace of its own (``unshare``; as root, or through a user namespace), no interface up;
- the filesystem through Landlock (kernel 5.13 on): reading only Python's own libraries and the system's shared
  libraries, and anything only within its own working directory (a fresh temporary one); the server's files, its
  state directory included, cannot be opened. Landlock's ABI 4 and later also refuses it TCP connections and binds,
  ABI 6 and later signals and abstract Unix sockets outside;
- no Internet sockets at all, through a seccomp filter (x86-64 and arm64): ``socket`` of IPv4, IPv6 or raw packets
  fails with EACCES (UDP included, which Landlock does not cover), as do ``io_uring_setup`` (its rings can open
  sockets) and calls of another ABI. This holds where no namespace can be had and under any Landlock ABI.

It imports nothing of coserve: it runs in a bare interpreter, and the grader's code runs after it.
"""

import ctypes
import json
import math
import os
import sys
import sysconfig

# Landlock's system calls (the same numbers on every architecture) and access rights (linux/landlock.h)
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # those a rule on a file (not a directory) takes
NET_TCP = 0b11  # bind and connect (ABI 4)
SCOPED = 0b11  # abstract Unix sockets and signals (ABI 6)
PR_SET_NO_NEW_PRIVS = 38
# the system's shared libraries (those Python's extension modules load) and the loader's cache
SYSTEM_LIBRARIES = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")


# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h): a filter refusing Internet sockets
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
LOAD_WORD, RETURN = 0x20, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_RET|BPF_K
JUMPS = {"eq": 0x15, "ge": 0x35}  # BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JGE|BPF_K
ALLOW, REFUSE = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO with EACCES
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (the first argument's low word: little-endian machines)
# machine: (AUDIT_ARCH_*, socket, io_uring_setup, the first number of another ABI's calls (x32), if any)
SYSCALLS = {"x86_64": (0xC000003E, 41, 425, 0x40000000), "aarch64": (0xC00000B7, 198, 425, None)}
INTERNET = (2, 10, 17)  # AF_INET, AF_INET6, AF_PACKET


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _socket_filter(arch: int, socket_nr: int, io_uring_nr: int, other_abi: int | None) -> list[_SockFilter]:
    """The filter's program: another architecture's or ABI's calls, ``io_uring_setup``, and ``socket`` of an
    Internet family are refused; anything else is allowed."""
    code = [("load", ARCH), ("eq", arch, "next", "refuse"), ("load", NR)]
    code += [("ge", other_abi, "refuse", "next")] if other_abi is not None else []
    code += [("eq", io_uring_nr, "refuse", "next"), ("eq", socket_nr, "next", "allow"), ("load", ARG0)]
    code += [("eq", family, "refuse", "next") for family in INTERNET]
    code += [("return", ALLOW), ("return", REFUSE)]
    where = {"next": None, "allow": len(code) - 2, "refuse": len(code) - 1}
    program = []
    for i, (op, k, *targets) in enumerate(code):
        if op in JUMPS:
            jt, jf = (0 if where[t] is None else where[t] - i - 1 for t in targets)
            program.append(_SockFilter(JUMPS[op], jt, jf, k))
        else:
            program.append(_SockFilter(LOAD_WORD if op == "load" else RETURN, 0, 0, k))
    return program


def _no_internet_sockets(libc) -> bool:
    """A seccomp filter on this process (and on any it starts): a socket of the Internet (IPv4, IPv6, raw packets)
    cannot be made, whatever namespaces and Landlock give; Unix sockets can. False where this machine's call
    numbers are not known here or the kernel refuses the filter."""
    machine = os.uname().machine
    if machine not in SYSCALLS:
        return False
    program = _socket_filter(*SYSCALLS[machine])
    prog = _SockFprog(len(program), (_SockFilter * len(program))(*program))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _no_network(libc) -> bool:
    """A network namespace of its own (with a user namespace where plain unshare is refused)."""
    return libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0  # NEWNET, +NEWUSER


def _readable() -> list[str]:
    """Where the process may read and execute: Python's standard library and installed packages (by sysconfig,
    not sys.path: a path an editable install adds may be the server's own directory) and the system's libraries."""
    paths = sysconfig.get_paths()
    return sorted({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | set(SYSTEM_LIBRARIES))


def _landlock(libc, workdir: str) -> tuple[bool, bool]:
    """Restrict this process's filesystem (and, from ABI 4, TCP) access; returns (filesystem, tcp) restricted."""
    abi = libc.syscall(CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    if abi < 1:
        return False, False
    fs = (1 << 13) - 1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0) | (IOCTL_DEV if abi >= 5 else 0)
    net, scoped = (NET_TCP if abi >= 4 else 0), (SCOPED if abi >= 6 else 0)
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct as this ABI knows it
    ruleset = libc.syscall(CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return False, False
    try:
        if not _add_rules(libc, ruleset, workdir, fs):
            return False, False
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(RESTRICT_SELF, ruleset, 0) != 0:
            return False, False
        return True, bool(net)
    finally:
        os.close(ruleset)


def _add_rules(libc, ruleset: int, workdir: str, fs: int) -> bool:
    """Allow reading Python's and the system's libraries, and everything within ``workdir``."""
    rules = [(p, EXECUTE | READ_FILE | READ_DIR) for p in _readable()]
    rules += [(workdir, fs), ("/dev/null", READ_FILE | WRITE_FILE)]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:  # not on this system
            continue
        if not os.path.isdir(path):
            rights &= FILE_RIGHTS
        beneath = _PathBeneathAttr(rights & fs, fd)
        added = libc.syscall(ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(beneath), ctypes.c_uint32(0))
        os.close(fd)
        if added != 0:
            return False
    return True


def _shut_in(workdir: str) -> dict:
    """No network and no filesystem beyond its own, as far as the kernel allows; says what it got."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        network = _no_network(libc)
        filesystem, tcp = _landlock(libc, workdir)
        sockets = _no_internet_sockets(libc)
    except (OSError, AttributeError):  # not Linux, or no such calls
        network = filesystem = tcp = sockets = False
    return {"network": network or tcp or sockets, "filesystem": filesystem, "sockets": sockets}


def _limit(job: dict) -> None:
    """Memory and file-size limits, soft and hard alike, so that the grader's code cannot raise them."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    for limit, value in ((resource.RLIMIT_AS, job["memory"]), (resource.RLIMIT_FSIZE, job["file_bytes"])):
        resource.setrlimit(limit, (value, value))


def main() -> None:
    job = json.load(sys.stdin)
    isolation = _shut_in(os.getcwd())
    _limit(job)
    space = {"__name__": "grader"}
    exec(compile(job["source"], "<grader source>", "exec"), space)
    grade = space["grade"]
    out = []
    for sample, item in job["pairs"]:
        try:
            value = grade(sample, item)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"grade() returned {value!r}, not a finite number")
            out.append({"value": float(value)})
        except Exception as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
    sys.stdout.write("\n" + json.dumps({"isolation": isolation, "out": out}))


if __name__ == "__main__":
    main()
