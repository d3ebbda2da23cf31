"""Run one model-written program (a HumanEval completion with its tests) with dangerous calls disabled.

Started by :func:`peft_sparse.evaluation.suite.run_program` as ``python -I run_untrusted.py PROGRAM`` in a fresh
temporary directory, under CPU-time and memory limits; never imported. Before the program runs, the calls a program
could use to harm the machine are replaced by functions that raise ``PermissionError``, as the reference HumanEval
harness does before it executes completions: starting processes (``os.system``, ``os.fork``, ``os.exec*``,
``os.spawn*``, ``subprocess``), signalling processes, removing, renaming or changing the mode or owner of files and
directories (``os``, ``shutil``), changing the environment, and opening network sockets. The program passes when it
runs to its end; an exception or an early exit (``sys.exit``, ``exit()``, ``os._exit``) fails it.

Like the reference harness's guard this stops accidents, not an adversary (a program can still reach the C library
through ``ctypes``, for example): run untrusted code inside a container or a virtual machine.
"""

import builtins
import os
import sys
import traceback

PROCESSES = (
    "system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execl", "execle", "execlp", "execlpe",
    "execv", "execve", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve",
    "spawnvp", "spawnvpe", "kill", "killpg", "_exit", "abort",
)  # fmt: skip
FILES = (
    "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod", "fchmod", "lchmod",
    "chown", "fchown", "lchown", "chflags", "lchflags", "chroot", "fchdir", "link", "symlink",
)  # fmt: skip
IDENTITY = ("setuid", "seteuid", "setgid", "setegid", "setreuid", "setregid", "setresuid", "setresgid", "putenv", "unsetenv")
SUBPROCESS = ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput")
SHUTIL = ("rmtree", "move", "chown")
SOCKETS = ("socket", "socketpair", "create_connection", "create_server", "fromfd")
MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter", "multiprocessing", "_posixsubprocess")  # (imports refused)


def _refused(what: str):
    def refused(*args, **kwargs):
        raise PermissionError(f"{what} is disabled while running model-written code")

    return refused


def _disable(module, names) -> None:
    for name in names:
        if hasattr(module, name):
            setattr(module, name, _refused(f"{module.__name__}.{name}"))


def guard() -> None:
    """Disable what the program must not do (module docstring)."""
    import faulthandler
    import shutil
    import socket
    import subprocess

    faulthandler.disable()
    os.environ["OMP_NUM_THREADS"] = "1"
    _disable(os, PROCESSES + FILES + IDENTITY)
    _disable(subprocess, SUBPROCESS)
    _disable(shutil, SHUTIL)
    _disable(socket, SOCKETS)
    builtins.exit = _refused("exit()")
    builtins.quit = _refused("quit()")
    for name in MODULES:
        sys.modules[name] = None


def main() -> None:
    finish = os._exit  # (kept before the guard replaces it)
    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    guard()
    try:
        exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": builtins})
    except BaseException:  # (SystemExit too: the program must run to its end)
        traceback.print_exc()
        sys.stderr.flush()
        finish(1)
    sys.stdout.flush()
    finish(0)


if __name__ == "__main__":
    del sys.path[0]  # (this package's folder: the program imports nothing from it)
    main()
