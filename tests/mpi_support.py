"""Launching MPI programs from the tests: finding ``mpiexec``, skipping
clearly without MPI, and running a script on P ranks so that a failure can
never hang the suite.

Scripts run as ``python -m mpi4py script.py``: an uncaught exception on one
rank then calls ``MPI_Abort`` and ends every rank, instead of leaving the
others blocked in a collective. ``mpiexec`` starts in a new session, and on a
timeout the whole process group is killed (killing ``mpiexec`` alone can leave
its ranks busy-waiting).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig


def find_mpiexec() -> str | None:
    """``mpiexec`` of this Python's environment first (MPICH's wheel installs
    it next to the interpreter), then the PATH."""
    for directory in (os.path.dirname(sys.executable), sysconfig.get_path("scripts")):
        found = shutil.which("mpiexec", path=directory)
        if found:
            return found
    return shutil.which("mpiexec")


def mpi_skip_reason() -> str | None:
    """Why MPI tests cannot run here, or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return 'mpi4py is not installed (pip install "npattn[mpi]")'
    if find_mpiexec() is None:
        return (
            "no mpiexec next to the Python executable, in the scripts dir or on PATH "
            '(pip install "npattn[mpi]" installs MPICH\'s)'
        )
    return None


#: Open MPI's ``mpiexec`` refuses to run as root without these (MPICH's, which
#: ``npattn[mpi]`` installs, ignores them); the GPU machines run the tests as
#: root with an Open MPI of their own.
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run_mpi(P: int, script, args=(), *, env=None, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m mpi4py script args...`` on P ranks; raise
    ``subprocess.TimeoutExpired`` after killing every process on a timeout."""
    command = [find_mpiexec(), "-n", str(P), sys.executable, "-m", "mpi4py", str(script), *map(str, args)]
    env = {**(os.environ if env is None else env), **OPEN_MPI_AS_ROOT}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
