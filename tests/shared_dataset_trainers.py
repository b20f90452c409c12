"""Trainer processes for the shared-dataset test: each builds one dataset of 100 MB on one worker.

Usage: python shared_dataset_trainers.py ADDRESS COUNT. Forks COUNT trainers at once (before this process
has a thread or a connection), each building ``helpers.Allocates(100)`` on ADDRESS. Prints ``built`` and
one digit per trainer (1: its dataset answered an item) once all are built; then, for each line ``go``
read from standard input, lets the next trainer read another item and exit, and prints its exit code.
"""

from __future__ import annotations

import os
import sys


def trainer(address: str, ready: int, go: int, inherited: list[int]) -> None:
    code = 1
    try:
        for fd in inherited:  # the write ends of the go pipes: once the parent is gone, reading go ends
            os.close(fd)
        from helpers import Allocates

        import rpcdl

        dataset = rpcdl.RPCDataset([address], Allocates, 100, rpcdl_timeout=60)
        os.write(ready, b"1" if dataset[3] == 3 else b"0")
        os.read(go, 1)
        code = 0 if dataset[2] == 2 else 3
    finally:
        os._exit(code)


def main(address: str, count: int) -> int:
    import rpcdl  # noqa: F401  (imported once, before the forks)

    ready_read, ready_write = os.pipe()
    children: list[tuple[int, int]] = []
    for _ in range(count):
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            trainer(address, ready_write, go_read, [go_write, *(go for _, go in children)])
        os.close(go_read)
        children.append((pid, go_write))
    answers = b""
    while len(answers) < count:
        answers += os.read(ready_read, count)
    print("built", answers.decode(), flush=True)
    for pid, go in children:
        if sys.stdin.readline().strip() != "go":
            break
        os.write(go, b"1")
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
