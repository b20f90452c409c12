"""The process's one event loop: its thread, its use from other threads, and a forked child's own."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from rpcdl.transport import event_loop


def test_the_loop_runs_in_its_named_thread_and_is_one_per_process():
    loop = event_loop.process_loop()
    assert event_loop.process_loop() is loop
    assert loop.is_running()

    async def where() -> tuple[str, bool]:
        return threading.current_thread().name, event_loop.in_loop_thread()

    assert event_loop.run_coroutine(where(), timeout=5) == (event_loop.THREAD_NAME, True)
    assert not event_loop.in_loop_thread()


def test_call_soon_runs_a_callback_on_the_loop():
    seen: list[str] = []
    done = threading.Event()

    def note() -> None:
        seen.append(threading.current_thread().name)
        done.set()

    event_loop.call_soon(note)
    assert done.wait(5)
    assert seen == [event_loop.THREAD_NAME]


def test_a_coroutine_that_outlasts_its_timeout_is_cancelled_and_named():
    cancelled = threading.Event()

    async def sleeper() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="did not finish"):
        event_loop.run_coroutine(sleeper(), timeout=0.05)
    assert cancelled.wait(5)


def test_waiting_for_the_loop_on_the_loop_itself_is_refused():
    async def nested() -> str:
        async def inner() -> int:
            return 1

        try:
            event_loop.run_coroutine(inner(), timeout=1)
        except RuntimeError as error:
            return str(error)
        return "not refused"

    assert "own thread" in event_loop.run_coroutine(nested(), timeout=5)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_a_loop_of_its_own():
    parent = event_loop.process_loop()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            child = event_loop.process_loop()

            async def one() -> int:
                return 1

            ok = child is not parent and child.is_running() and event_loop.run_coroutine(one(), timeout=5) == 1
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
