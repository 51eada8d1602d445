"""Process limits raised by programs that hold many connections."""

from __future__ import annotations


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit: a server holds a socket
    per connected client process, a load generator one per virtual process. Returns the soft
    limit now in force (-1 where the platform has no such limit)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit that the kernel caps lower
        return soft
    return hard
