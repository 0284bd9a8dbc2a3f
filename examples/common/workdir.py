"""A trainer's workdir, crash-safe: one trainer at a time, and a metrics record that a
kill at any moment leaves readable.

* `WorkdirLock`: an exclusive lock file (WORKDIR/.lock, flock, released by the OS when
  the process dies, even by SIGKILL) holding the owner's process id; a second trainer on
  the same workdir stops with an error naming it.
* `MetricsLog`: JSON lines in WORKDIR/metrics.jsonl, each appended with one write and
  flushed to disk; on resume the lines past the restored step are dropped, and a last
  line cut short by a kill is dropped with a note (a damaged line before it is an error).
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib


class WorkdirLock:
    """Holds WORKDIR/.lock exclusively for the life of a run (`with WorkdirLock(dir):`)."""

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> "WorkdirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(
                f"workdir: {self.path.parent} is in use by another trainer (process {owner}); "
                "wait for it to finish, stop it, or use another --workdir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing releases the flock
            self._fd = None


class MetricsLog:
    """Appends JSON lines; on resume keeps only the intact lines up to the restored step."""

    def __init__(self, path: pathlib.Path, resume_step: int):
        self.path = path
        kept = []
        if path.exists():
            text = path.read_text()
            lines = text.splitlines()
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    if number == len(lines) and not text.endswith("\n"):
                        print(f"metrics: dropped the last line of {path}, cut short by an "
                              "interrupted run", flush=True)
                        continue
                    raise ValueError(
                        f"metrics: line {number} of {path} is not JSON ({line[:60]!r}); "
                        "repair or delete that line, or use a fresh --workdir.") from None
                if record.get("step", 0) <= resume_step:
                    kept.append(line)
        self._write_atomically("".join(line + "\n" for line in kept))

    def _write_atomically(self, text: str) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        with temporary.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.path)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict]:
        return [json.loads(l) for l in self.path.read_text().splitlines() if l.strip()]
