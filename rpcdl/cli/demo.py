"""``rpcdl demo``: train a small CNN on scikit-learn's digits through rpcdl workers and Lightning."""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .args import Deprecated, add_workers_argument, existing_file, new_file, positive_int, silent_worker

HELP = "train a small CNN on scikit-learn's digits through local (or given) workers"
DESCRIPTION = (
    "Start two rpcdl worker processes on loopback (or use running ones with --workers), train the "
    "configs/digits.yaml model with LightningCLI, the digits dataset and its random augmentation living "
    "on the workers, and print a summary: validation accuracy, samples per second delivered, and what "
    "each worker did. Needs the demo extra: pip install 'rpcdl[demo]'."
)


def _limit(text: str) -> int | float:
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a batch count or a fraction in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a batch count or a fraction in (0, 1], got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rpcdl demo``."""
    add_workers_argument(parser, "use these running workers (rpcdl worker) instead of starting local ones")
    parser.add_argument(
        "--local-workers",
        type=positive_int,
        default=2,
        metavar="N",
        help="worker processes to start on loopback when --workers is not given (default: %(default)s)",
    )
    parser.add_argument(
        "--max-epochs", type=positive_int, metavar="N", help="training epochs (default: the config's, 8)"
    )
    parser.add_argument(
        "--limit",
        type=_limit,
        metavar="N|F",
        help="train on only N batches (or a fraction F) of each epoch, for a quick run",
    )
    parser.add_argument("--batch-size", type=positive_int, metavar="N", help="training batch size (default: 32)")
    parser.add_argument("--seed", type=int, help="seed of the model, the shuffle and the augmentation (default: 0)")
    parser.add_argument(
        "--config",
        metavar="YAML",
        type=existing_file,
        help="LightningCLI config to train (default: the packaged configs/digits.yaml)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        type=existing_file,
        help="file holding the token of the workers, given to the local ones too (default: $RPCDL_TOKEN or "
        "$RPCDL_TOKEN_FILE)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide Lightning's progress bar")
    parser.add_argument("--json", metavar="FILE", type=new_file, help="also write the summary to FILE as JSON")
    parser.add_argument(
        "--summary-json", type=new_file, dest="json", action=Deprecated, new="--json", help=argparse.SUPPRESS
    )


@contextlib.contextmanager
def config_file(name: str) -> Iterator[Path]:
    """A path to the packaged config ``name`` (e.g. ``"digits.yaml"``) for as long as the context lasts."""
    try:
        resource = importlib.resources.files("rpcdl.configs").joinpath(name)
    except ModuleNotFoundError:
        # an editable install made before configs/ was mapped into the package
        source = Path(__file__).resolve().parent.parent / "configs" / name
        if not source.is_file():
            raise FileNotFoundError(f"rpcdl's config {name} is not installed; reinstall rpcdl") from None
        yield source
        return
    if not resource.is_file():
        raise FileNotFoundError(f"rpcdl ships no config named {name!r}")
    with importlib.resources.as_file(resource) as path:
        yield path


def _summary_callback() -> Any:
    import lightning.pytorch as pl

    class Throughput(pl.Callback):
        """Counts the samples the loaders delivered while training, and the time it took."""

        def __init__(self) -> None:
            self.samples = 0
            self.started = self.ended = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.started = time.perf_counter()

        def on_train_end(self, trainer, pl_module) -> None:
            self.ended = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.samples += _batch_length(batch)

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
            if self.started is not None:
                self.samples += _batch_length(batch)

    return Throughput()


def _batch_length(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return len(first)


def _warm_up() -> None:
    """Runs on each worker while the trainer starts: import scikit-learn and read the digits once."""
    from ..examples.digits import load_digits

    load_digits()


def _worker_counters(workers: list[str]) -> dict[str, dict[str, Any]]:
    from ..rpc.client import stats

    counters = {}
    for address in workers:
        try:
            counters[address] = stats(address, timeout=10.0)
        except Exception as exc:
            counters[address] = {"error": str(exc)}
    return counters


def _train(args: argparse.Namespace, workers: list[str], config: Path, warming: list[Any]) -> dict[str, Any]:
    from rpcdl.integrations.lightning import cli_main

    cli_args = ["--config", str(config), "--data.init_args.workers", json.dumps(workers)]
    cli_args += ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    if args.max_epochs is not None:
        cli_args += ["--trainer.max_epochs", str(args.max_epochs)]
    if args.limit is not None:
        cli_args += ["--trainer.limit_train_batches", str(args.limit)]
    if args.batch_size is not None:
        cli_args += ["--data.init_args.batch_size", str(args.batch_size)]
    if args.seed is not None:
        cli_args += ["--seed_everything", str(args.seed), "--data.init_args.seed", str(args.seed)]
    if args.no_progress:
        cli_args += ["--trainer.enable_progress_bar", "false"]
    _progress("building the model and the trainer...")
    # LightningCLI warns when it is given args while sys.argv holds others (the demo's own options).
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        cli = cli_main(args=cli_args, run=False, save_config_callback=None)
    finally:
        sys.argv = argv
    throughput = _summary_callback()
    cli.trainer.callbacks.append(throughput)
    _progress("loading the digits on the workers...")
    for future in warming:
        with contextlib.suppress(Exception):  # a worker that cannot load the data fails the fit, with its reason
            future.wait()
    _progress(f"training for {_epochs(cli.trainer.max_epochs)}...")
    before = _worker_counters(workers)
    started = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall = time.perf_counter() - started
    after = _worker_counters(workers)
    metrics = {name: float(value) for name, value in cli.trainer.callback_metrics.items()}
    training_s = (throughput.ended or time.perf_counter()) - (throughput.started or started)
    served = getattr(cli.datamodule, "batches_served", {})
    per_worker = {}
    for address in workers:
        old, new = before.get(address, {}), after.get(address, {})
        per_worker[address] = {
            "batches": served.get(address, 0),
            "calls": new.get("calls_served", 0) - old.get("calls_served", 0),
            "busy_s": round(new.get("busy_s", 0.0) - old.get("busy_s", 0.0), 3),
            "error": new.get("error"),
        }
    return {
        "epochs": cli.trainer.current_epoch,
        "val_acc": metrics.get("val_acc"),
        "val_loss": metrics.get("val_loss"),
        "samples": throughput.samples,
        "training_s": round(training_s, 3),
        "samples_per_s": round(throughput.samples / training_s, 1) if training_s > 0 else None,
        "fit_s": round(wall, 3),
        "workers": per_worker,
    }


def _print_summary(summary: dict[str, Any], total_s: float) -> None:
    accuracy = summary["val_acc"]
    shown = f"{accuracy:.3f}" if accuracy is not None else "n/a (no validation ran)"
    print()
    print(f"rpcdl demo: {_epochs(summary['epochs'])} in {total_s:.1f} s (training {summary['training_s']:.1f} s)")
    print(f"  validation accuracy  {shown}")
    print(
        f"  samples delivered    {summary['samples']} (train and val) at {summary['samples_per_s'] or 0:.0f} samples/s"
    )
    rows = [("worker", "batches", "calls", "busy s")]
    for address, counters in summary["workers"].items():
        if counters.get("error"):
            rows.append((address, str(counters["batches"]), "?", f"unreachable: {counters['error']}"))
        else:
            rows.append((address, str(counters["batches"]), str(counters["calls"]), f"{counters['busy_s']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  " + "  ".join([row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2].rjust(widths[2]), row[3]]))


def _epochs(count: int) -> str:
    return f"{count} epoch" if count == 1 else f"{count} epochs"


def _progress(step: str) -> None:
    print(f"rpcdl demo: {step}", flush=True)


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's info lines (hardware found, seeds, tips and adverts) hidden; its warnings still shown."""
    import logging

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def run(args: argparse.Namespace) -> int:
    """Run the demo; return the exit code."""
    if args.token_file:
        from ..transport.security import TOKEN_ENV, TOKEN_FILE_ENV, read_token_file

        try:
            read_token_file(args.token_file)
        except (OSError, ValueError) as exc:
            args.fail(f"--token-file: {exc}")
        # the trainer, and the local workers started with this environment, read the same token; the option
        # overrides the environment, as rpcdl worker's does
        os.environ.pop(TOKEN_ENV, None)
        os.environ[TOKEN_FILE_ENV] = args.token_file
    _progress("loading Lightning and scikit-learn...")  # the imports take seconds, more on a busy machine
    try:
        import lightning.pytorch  # noqa: F401
        import sklearn  # noqa: F401
    except ImportError as exc:
        print(f"rpcdl demo needs the demo extra ({exc.name} is missing): pip install 'rpcdl[demo]'", file=sys.stderr)
        return 2
    with _quiet_lightning():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ..local import local_workers
    from ..rpc.client import rpc_async

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.config:
            config = Path(args.config)
            if not config.is_file():
                print(f"rpcdl demo: no config file {args.config}", file=sys.stderr)
                return 2
        else:
            config = stack.enter_context(config_file("digits.yaml"))
        if args.workers:
            problem = silent_worker(args.workers, timeout=5.0)
            if problem:
                print(f"rpcdl demo: {problem}", file=sys.stderr)
                return 1
            workers = list(args.workers)
        else:
            _progress(f"starting {args.local_workers} local workers...")
            workers = list(stack.enter_context(local_workers(args.local_workers)))
            _progress(f"workers ready at {', '.join(workers)}")
        warming = [rpc_async(address, _warm_up, timeout=120.0) for address in workers]
        summary = _train(args, workers, config, warming)
    total = time.perf_counter() - started
    summary["total_s"] = round(total, 3)
    _print_summary(summary, total)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0
