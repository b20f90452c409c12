"""The deployment recipes of the documentation, checked here.

- Slurm (deploy/slurm/train.sbatch): the worker step runs as written minus
  ``srun`` (N workers with ``--port 0 --address-file F``), the script's own
  wait loop sees them all, and the trainer step's command line, parsed by
  LightningCLI as written minus ``srun``, reads F and trains from those workers.
- Kubernetes (deploy/kubernetes/*.yaml): the manifests agree with each other
  and with rpcdl's command line (no cluster here to apply them to).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rpcdl.address import is_loopback, parse_address

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"
KUBERNETES = ROOT / "deploy" / "kubernetes"
NUM_WORKERS = 3


# ---------------------------------------------------------------------------- Slurm


def _logical_lines(script: str) -> list[str]:
    """The script's commands, continuation lines joined."""
    lines, current = [], ""
    for line in script.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return lines


def _srun_step(script: str, group: int) -> str:
    """The command that ``srun --het-group=<group>`` runs, without srun, its options and a trailing ``&``."""
    for line in _logical_lines(script):
        words = line.split()
        if words[:2] == ["srun", f"--het-group={group}"]:
            rest = line.strip()[len("srun") :].strip()
            while rest.startswith("-"):
                rest = rest.split(None, 1)[1]
            return rest.removesuffix("&").strip()
    raise AssertionError(f"{SBATCH} has no `srun --het-group={group}` step")


def _wait_loop(script: str) -> str:
    match = re.search(r"^while .*?^done$", script, flags=re.S | re.M)
    assert match, f"{SBATCH} has no wait loop"
    return match.group(0)


def _expand_words(command: str, env: dict[str, str]) -> list[str]:
    """Split and expand ``command`` exactly as bash would (quotes, ``$VARIABLES``)."""
    printed = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"], env=env, capture_output=True, check=True, timeout=30
    )
    return printed.stdout.decode().split("\0")[:-1]


def _reachable(address: str) -> str:
    """``address``, with its host replaced by 127.0.0.1 if it does not resolve to loopback here.

    Tests contact loopback only. A worker listening on 0.0.0.0 advertises this
    machine's name, which resolves to loopback on most test machines; elsewhere
    the same worker is reached through 127.0.0.1.
    """
    host, port = parse_address(address)
    return address if is_loopback(host) else f"127.0.0.1:{port}"


@pytest.mark.filterwarnings("ignore:Starting from v1.9.0:UserWarning")
def test_slurm_recipe_runs_without_srun(tmp_path, monkeypatch):
    script = SBATCH.read_text()
    worker_command = _srun_step(script, group=1)
    assert re.search(r"--port 0\b", worker_command) and "--address-file" in worker_command, worker_command
    trainer_command = _srun_step(script, group=0)

    token_file = tmp_path / "token"
    token_file.write_text("a-secret-for-this-test\n")
    token_file.chmod(0o600)
    workers_file = tmp_path / "workers"
    workers_file.write_text("")  # the script's `: > "$WORKERS_FILE"`
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCDL_")}
    env.update(
        RPCDL_TOKEN_FILE=str(token_file),
        WORKERS_FILE=str(workers_file),
        NUM_WORKERS=str(NUM_WORKERS),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )

    # The worker step, as srun would run it on each of NUM_WORKERS tasks.
    workers = [
        subprocess.Popen(["bash", "-c", f"exec {worker_command}"], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(NUM_WORKERS)
    ]
    try:
        # The script's wait loop, with the first task standing for the worker step.
        subprocess.run(
            ["bash", "-c", f"set -eu\n{_wait_loop(script)}"],
            env={**env, "WORKERS_STEP": str(workers[0].pid)},
            check=True,
            timeout=60,
        )
        addresses = workers_file.read_text().split()
        assert len(addresses) == len(set(addresses)) == NUM_WORKERS, addresses
        printed = [process.stdout.readline().strip() for process in workers]
        assert sorted(printed) == sorted(addresses)  # the ready lines match the file
        for address in addresses:
            assert parse_address(address)[0] == socket.gethostname()  # --host 0.0.0.0 advertises the node's name
        if not all(_reachable(a) == a for a in addresses):
            workers_file.write_text("".join(_reachable(a) + "\n" for a in addresses))
            addresses = [_reachable(a) for a in addresses]

        # The trainer step as written (minus srun): LightningCLI parses the same
        # command line; its data module reads the address file and loads a
        # training epoch from the workers.
        words = _expand_words(trainer_command, env)
        assert words[:3] == ["python", "-m", "rpcdl.integrations.lightning"], words
        assert words[3] == "fit" and str(workers_file) in words
        monkeypatch.chdir(ROOT)
        monkeypatch.setattr(sys, "argv", words[2:3])  # as `python -m` would set it
        monkeypatch.setenv("RPCDL_TOKEN_FILE", str(token_file))
        _train_one_epoch(words[4:], addresses)

        # The script's `kill "$WORKERS_STEP"`: SIGTERM, and the workers exit cleanly.
        for process in workers:
            process.send_signal(signal.SIGTERM)
        for process in workers:
            assert process.wait(timeout=30) == 0
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()


def _train_one_epoch(cli_args: list[str], addresses: list[str]) -> None:
    import rpcdl
    from rpcdl.integrations.lightning import cli_main

    cli = cli_main(args=cli_args, run=False)
    data = cli.datamodule
    data.trainer = cli.trainer
    try:
        data.setup("fit")
        assert data.all_workers == addresses  # read from the file, in its order
        assert data.workers == addresses  # one rank: all of them
        loader = data.train_dataloader()
        samples = sum(len(labels) for _, labels in loader)
        assert samples == len(data.datasets["train"])
        served = loader.batches_served
        assert sum(served.values()) == len(loader)
        assert set(served) == set(addresses)
    finally:
        data.teardown("fit")
        rpcdl.shutdown()


# ---------------------------------------------------------------------------- Kubernetes


def _manifests() -> dict[str, dict]:
    import yaml  # PyYAML comes with the lightning extra (jsonargparse)

    documents = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                documents[f"{document['kind']}/{document['metadata']['name']}"] = document
    return documents


def _container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def test_kubernetes_manifests_fit_together():
    from rpcdl.cli import build_parser

    docs = _manifests()
    service = docs["Service/rpcdl-worker"]
    workers = docs["StatefulSet/rpcdl-worker"]
    trainer = docs["Job/rpcdl-trainer"]

    # A headless service gives each worker pod a stable name: rpcdl-worker-<i>.rpcdl-worker.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses") is True
    assert workers["spec"]["serviceName"] == service["metadata"]["name"]
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())

    # The worker container runs `rpcdl worker` with options rpcdl accepts.
    pod = workers["spec"]["template"]["spec"]
    container = _container(pod, "worker")
    command = container["command"] + container.get("args", [])
    assert command[:2] == ["rpcdl", "worker"], command
    options = build_parser().parse_args(command[1:])
    assert options.host == "0.0.0.0" and options.port > 0
    assert {"containerPort": options.port, "name": "rpcdl"}.items() <= container["ports"][0].items()
    assert service["spec"]["ports"][0]["port"] == options.port

    # Workers and trainer read the token from the same Secret, as a file.
    def token_secret(pod_spec: dict, container: dict) -> str:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        token_path = Path(env["RPCDL_TOKEN_FILE"])
        mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == token_path.parent)
        volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
        items = volume["secret"].get("items")
        if items:  # the Secret's key "token" is mounted under the file name RPCDL_TOKEN_FILE names
            assert {"key": "token", "path": token_path.name} in items
        else:
            assert token_path.name == "token"
        return volume["secret"]["secretName"]

    trainer_pod = trainer["spec"]["template"]["spec"]
    trainer_container = _container(trainer_pod, "trainer")
    secret = token_secret(pod, container)
    assert secret == token_secret(trainer_pod, trainer_container)
    assert f"Secret/{secret}" in docs
    assert "token" in docs[f"Secret/{secret}"].get("stringData", docs[f"Secret/{secret}"].get("data", {}))

    # The trainer names every worker pod through the headless service, on the worker port.
    env = {e["name"]: e.get("value") for e in trainer_container["env"]}
    addresses = env["RPCDL_WORKERS"].split(",")
    expected = [
        f"{workers['metadata']['name']}-{i}.{service['metadata']['name']}:{options.port}"
        for i in range(workers["spec"]["replicas"])
    ]
    assert addresses == expected


def test_kubernetes_metrics_and_autoscaling_fit_the_workers_and_the_trainer():
    import yaml

    from rpcdl.cli import build_parser
    from rpcdl.metrics.names import TRAINER_METRICS

    docs = _manifests()
    workers = docs["StatefulSet/rpcdl-worker"]
    trainer = docs["Job/rpcdl-trainer"]
    worker_container = _container(workers["spec"]["template"]["spec"], "worker")
    trainer_container = _container(trainer["spec"]["template"]["spec"], "trainer")

    def port_named(container: dict, name: str) -> int:
        return next(p["containerPort"] for p in container["ports"] if p["name"] == name)

    # Each worker serves its metrics on the port its container names "metrics".
    options = build_parser().parse_args(worker_container["command"][1:] + worker_container["args"])
    assert options.metrics_port == port_named(worker_container, "metrics")
    # The trainer serves them on all its interfaces, on its port named "metrics".
    env = {e["name"]: e.get("value") for e in trainer_container["env"]}
    host, port = parse_address(env["RPCDL_METRICS_PORT"])
    assert host == "0.0.0.0" and port == port_named(trainer_container, "metrics")

    # Prometheus scrapes both: each PodMonitor selects its pods' labels and names a port they have.
    for monitor, pods, container in (
        ("PodMonitor/rpcdl-worker", workers, worker_container),
        ("PodMonitor/rpcdl-trainer", trainer, trainer_container),
    ):
        spec = docs[monitor]["spec"]
        labels = pods["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), monitor
        assert all(port_named(container, endpoint["port"]) for endpoint in spec["podMetricsEndpoints"])

    # Both autoscalers scale the worker StatefulSet on the trainers' rpcdl_workers_needed, one replica per
    # worker needed.
    target = {"apiVersion": workers["apiVersion"], "kind": workers["kind"], "name": workers["metadata"]["name"]}
    assert "rpcdl_workers_needed" in TRAINER_METRICS
    hpa = docs["HorizontalPodAutoscaler/rpcdl-worker"]["spec"]
    assert hpa["scaleTargetRef"] == target
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "rpcdl_workers_needed"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    adapter = yaml.safe_load(docs["ConfigMap/prometheus-adapter"]["data"]["config.yaml"])
    (rule,) = adapter["externalRules"]
    assert rule["name"]["as"] == metric["external"]["metric"]["name"]
    assert rule["seriesQuery"].startswith("rpcdl_workers_needed{")
    assert "<<.Series>>" in rule["metricsQuery"] and "sum(" in rule["metricsQuery"]

    keda = docs["ScaledObject/rpcdl-worker"]["spec"]
    assert keda["scaleTargetRef"] == target
    (trigger,) = keda["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    assert re.search(r"\bsum\(.*\brpcdl_workers_needed\{", trigger["metadata"]["query"])
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])


def test_kubernetes_worker_pool_deployment_drains_within_its_grace_and_is_ready_only_while_serving():
    """The Deployment recipe: a headless Service of ready pods, a readiness probe, a preStop that drains, and a
    termination grace that covers --drain-timeout."""
    from rpcdl.cli import build_parser

    docs = _manifests()
    service = docs["Service/rpcdl-pool"]
    pool = docs["Deployment/rpcdl-pool"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False  # a draining or unready pod leaves DNS
    labels = pool["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()

    pod = pool["spec"]["template"]["spec"]
    container = _container(pod, "worker")
    command = container["command"] + container["args"]
    options = build_parser().parse_args(command[1:])
    assert options.host == "0.0.0.0" and service["spec"]["ports"][0]["port"] == options.port
    assert "--drain-timeout" in command  # said, not left to the default
    env = {e["name"]: e for e in container["env"]}
    assert options.advertise == "$(POD_IP)" and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    # The drain fits in the grace, with a margin; the preStop hook drains and waits no longer than the grace.
    grace = pod["terminationGracePeriodSeconds"]
    assert options.grace + 5 <= grace <= options.grace + 60
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in pre_stop
    waits = int(re.search(r"seq (\d+)", pre_stop).group(1))
    assert options.grace < waits <= grace

    # Ready only while it serves: the probe is a real handshake on the worker's port.
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["rpcdl", "status"] and probe[2] == f"127.0.0.1:{options.port}"
    assert container["readinessProbe"]["failureThreshold"] == 1
