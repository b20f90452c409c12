"""Map items through a function on remote workers, results in source order.

The scheduler behind :class:`~rpcdl.integrations.torchdata.RPCMapper` and the
``rpc_map`` DataPipe. Each item pulled from the source goes to the active
worker with the fewest calls in flight, at most ``prefetch_factor`` calls per
worker, and at most ``prefetch_factor`` items per active worker are pulled and
not yet handed out. A worker that fails with an infrastructure error
(:func:`rpcdl.errors.is_transient`) is taken out: its items go to the others
and it is probed in the background until it answers again. An exception raised
by the function itself is not retried: it is handed out in the item's place.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rpcdl import ping, rpc_async
from rpcdl.address import parse_address
from rpcdl.dataloader import NoWorkersLeft
from rpcdl.errors import WorkerTimeout, is_transient

log = logging.getLogger("rpcdl.integrations.remote_map")

_PROBE_TIMEOUT = 10.0
_FIRST_PROBE_DELAY = 0.2
_MAX_PROBE_DELAY = 5.0
_IDLE_WAIT = 0.5


def _probe(slot: _Slot, timeout: float, events: queue.SimpleQueue) -> None:
    """Ping a worker that failed (pings are answered even while calls run there) and report."""
    try:
        ping(slot.address, timeout=timeout)
    except Exception as exc:
        events.put(("probe", slot, exc))
    else:
        events.put(("probe", slot, None))


def check_workers(workers: Any) -> list[str]:
    """Validate a list of worker addresses and return it as a plain list of strings."""
    if isinstance(workers, str) or not isinstance(workers, Sequence) or not workers:
        raise TypeError(
            f"workers must be a non-empty list of 'host:port' strings, got {workers!r}; "
            "start workers with `rpcdl worker` or use rpcdl.local_workers(n)"
        )
    for address in workers:
        parse_address(address)
    if len(set(workers)) != len(workers):
        raise ValueError(f"workers lists the same worker twice: {list(workers)}")
    return [str(address) for address in workers]


def check_fn(fn: Any) -> None:
    """Validate the function sent to the workers."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (it is sent to the workers), got {type(fn).__name__}: {fn!r}")


def check_options(prefetch_factor: Any, timeout: Any) -> None:
    """Validate the in-flight bound and the timeout of a remote map or loader."""
    if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1:
        raise ValueError(
            f"prefetch_factor must be a positive integer (calls in flight per worker), got {prefetch_factor!r}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


class _State(enum.Enum):
    ACTIVE = "active"
    DOWN = "down"  # failed; probed until it answers
    PROBING = "probing"  # a probe is in flight


class _Slot:
    __slots__ = ("address", "failure", "in_flight", "last_sent", "probe_at", "probe_delay", "served", "state")

    def __init__(self, address: str):
        self.address = address
        self.state = _State.ACTIVE
        self.in_flight: set[_Attempt] = set()
        self.last_sent = 0.0
        self.probe_at = 0.0
        self.probe_delay = _FIRST_PROBE_DELAY
        self.failure: BaseException | None = None
        self.served = 0


class Task:
    """One item of the source: its position, the caller's tag, and once done its result or error."""

    __slots__ = ("attempts", "done", "error", "item", "seq", "tag", "timeouts", "value")

    def __init__(self, seq: int, item: Any, tag: Any):
        self.seq, self.item, self.tag = seq, item, tag
        self.attempts: list[_Attempt] = []
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.timeouts = 0


class _Attempt:
    __slots__ = ("live", "slot", "task")

    def __init__(self, task: Task, slot: _Slot):
        self.task, self.slot, self.live = task, slot, True


class RemoteMap:
    """The workers, their health and the calls in flight, kept across passes over sources.

    Args:
        workers: worker addresses.
        fn: the function applied to each item, on a worker (sent with each call).
        prefetch_factor: calls in flight per worker.
        timeout: seconds a call may take before its item goes to another
            worker; also how long to wait for a worker when none is left.
        pin_memory: receive results into pinned memory when CUDA is available.
    """

    def __init__(self, workers: Sequence[str], fn: Callable, *, prefetch_factor: int, timeout: float, pin_memory: bool):
        self.fn = fn
        self.prefetch_factor = prefetch_factor
        self.timeout = float(timeout)
        self.pin_memory = pin_memory
        self.pid = os.getpid()
        self._slots = [_Slot(address) for address in workers]
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._pass: Pass | None = None

    @property
    def items_served(self) -> dict[str, int]:
        return {slot.address: slot.served for slot in self._slots}

    def worker_states(self) -> dict[str, str]:
        return {slot.address: slot.state.value for slot in self._slots}

    def start(self, pull: Callable[[], tuple[Any, Any]]) -> Pass:
        """Begin a pass over a source; ``pull()`` returns ``(item, tag)`` or raises StopIteration."""
        if self._pass is not None:
            self._pass.close()
        now = time.monotonic()
        for slot in self._slots:
            if slot.state == _State.DOWN:
                slot.probe_at = now
        self._pass = Pass(self, pull)
        return self._pass


class Pass:
    """One pass over a source: an iterator of :class:`Task`, done, in source order."""

    def __init__(self, remote_map: RemoteMap, pull: Callable[[], tuple[Any, Any]]):
        self._map = remote_map
        self._slots = remote_map._slots
        self._events = remote_map._events
        self._pull = pull
        self._seq = itertools.count()
        self._tasks: collections.deque[Task] = collections.deque()  # pulled, not handed out
        self._waiting: collections.deque[Task] = collections.deque()  # to (re)send, oldest first
        self._source_done = False
        self._all_down_since: float | None = None
        self.closed = False

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> Task:
        if self.closed:
            raise StopIteration
        while True:
            if self._tasks and self._tasks[0].done:
                return self._tasks.popleft()
            if self._source_done and not self._tasks:
                self.close()
                raise StopIteration
            self._dispatch()
            self._probe_due()
            self._handle_events()

    def close(self) -> None:
        """Stop the pass; answers still in flight are dropped when they arrive."""
        self.closed = True
        for task in self._tasks:
            for attempt in task.attempts:
                attempt.live = False
                attempt.slot.in_flight.discard(attempt)
        self._tasks.clear()
        self._waiting.clear()

    def __del__(self):
        if not self.closed:
            self.close()

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        active = sum(slot.state == _State.ACTIVE for slot in self._slots)
        window = self._map.prefetch_factor * max(active, 1)
        while True:
            if not self._waiting:
                if self._source_done or len(self._tasks) >= window:
                    return
                try:
                    item, tag = self._pull()
                except StopIteration:
                    self._source_done = True
                    return
                task = Task(next(self._seq), item, tag)
                self._tasks.append(task)
                self._waiting.append(task)
            slot = self._pick()
            if slot is None:
                return
            self._send(self._waiting.popleft(), slot)

    def _pick(self) -> _Slot | None:
        free = [
            slot
            for slot in self._slots
            if slot.state == _State.ACTIVE and len(slot.in_flight) < self._map.prefetch_factor
        ]
        if not free:
            return None
        return min(free, key=lambda slot: (len(slot.in_flight), slot.last_sent))

    def _send(self, task: Task, slot: _Slot) -> None:
        remote_map = self._map
        attempt = _Attempt(task, slot)
        slot.last_sent = time.monotonic()
        try:
            future = rpc_async(
                slot.address, remote_map.fn, (task.item,), pin_memory=remote_map.pin_memory, timeout=remote_map.timeout
            )
        except Exception as exc:
            if is_transient(exc):
                self._waiting.appendleft(task)
                self._mark_down(slot, exc)
            else:  # the item or fn cannot be sent: its error takes its place
                task.error, task.done = exc, True
            return
        task.attempts.append(attempt)
        slot.in_flight.add(attempt)
        future.add_done_callback(lambda done: self._events.put(("result", attempt, done)))

    # ------------------------------------------------------------------ events

    def _handle_events(self) -> None:
        now = time.monotonic()
        deadline = now + _IDLE_WAIT
        probes = [slot.probe_at for slot in self._slots if slot.state == _State.DOWN]
        if probes:
            deadline = min(deadline, min(probes))
        try:
            event = self._events.get(timeout=max(0.0, deadline - now))
        except queue.Empty:
            self._check_no_workers()
            return
        while True:
            kind, subject, outcome = event
            if kind == "result":
                self._on_result(subject, outcome)
            else:
                self._on_probe(subject, outcome)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
        self._check_no_workers()

    def _on_result(self, attempt: _Attempt, future: torch.futures.Future) -> None:
        slot, task = attempt.slot, attempt.task
        slot.in_flight.discard(attempt)
        if not attempt.live or task.done or self.closed:
            return
        attempt.live = False
        try:
            task.value = future.wait()
        except Exception as exc:
            if is_transient(exc):
                self._mark_down(slot, exc)
                if isinstance(exc, WorkerTimeout):
                    task.timeouts += 1
                if task.timeouts < len(self._slots):
                    self._retry(task)
                    return
                exc.add_note(
                    f"item {task.seq} of this pass timed out on {task.timeouts} workers: "
                    f"{_name(self._map.fn)} takes longer than timeout={self._map.timeout:g}s; raise the timeout"
                )
            else:
                exc.add_note(f"while mapping item {task.seq} with {_name(self._map.fn)} on {slot.address}")
            task.error = exc
        else:
            slot.served += 1
        task.done = True

    def _retry(self, task: Task) -> None:
        if not task.done and not any(a.live for a in task.attempts) and task not in self._waiting:
            self._waiting.appendleft(task)

    def _mark_down(self, slot: _Slot, exc: BaseException) -> None:
        if slot.state == _State.ACTIVE:
            log.warning("worker %s left: %s", slot.address, exc)
        slot.state = _State.DOWN
        slot.failure = exc
        slot.probe_at = time.monotonic() + slot.probe_delay
        slot.probe_delay = min(slot.probe_delay * 2, _MAX_PROBE_DELAY)
        for attempt in list(slot.in_flight):
            attempt.live = False
            self._retry(attempt.task)
        slot.in_flight.clear()
        self._waiting = collections.deque(sorted(self._waiting, key=lambda t: t.seq))

    # ------------------------------------------------------------------ probes

    def _probe_due(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if slot.state != _State.DOWN or slot.probe_at > now:
                continue
            slot.state = _State.PROBING
            timeout = min(self._map.timeout, _PROBE_TIMEOUT)
            threading.Thread(
                target=_probe, args=(slot, timeout, self._events), name=f"rpcdl-probe-{slot.address}", daemon=True
            ).start()

    def _on_probe(self, slot: _Slot, failure: BaseException | None) -> None:
        if slot.state != _State.PROBING:
            return
        if failure is not None:
            slot.state = _State.DOWN
            slot.failure = failure
            slot.probe_at = time.monotonic() + slot.probe_delay
            slot.probe_delay = min(slot.probe_delay * 2, _MAX_PROBE_DELAY)
            return
        log.warning("worker %s is back", slot.address)
        slot.state = _State.ACTIVE
        slot.probe_delay = _FIRST_PROBE_DELAY

    def _check_no_workers(self) -> None:
        if any(slot.state == _State.ACTIVE for slot in self._slots):
            self._all_down_since = None
            return
        now = time.monotonic()
        if self._all_down_since is None:
            self._all_down_since = now
        if now - self._all_down_since < self._map.timeout:
            return
        self.close()
        details = "; ".join(f"{slot.address} ({slot.state.value}: {slot.failure})" for slot in self._slots)
        raise NoWorkersLeft(f"no worker is left (waited {self._map.timeout:g}s for one to come back): {details}")


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
