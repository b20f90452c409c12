"""Rules of torch's DataLoader that :class:`~rpcdl.RPCDataloader` keeps beside its own code.

Threading: constants and a pure function; no state.
"""

from __future__ import annotations

from typing import Any

#: Attributes torch's DataLoader refuses to change after construction (``persistent_workers`` has no
#: meaning here: setting it is refused all the same, rather than ignored).
FIXED_ATTRIBUTES = frozenset(("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"))
#: torch DataLoader arguments that have no place here, and what replaces each.
TORCH_ONLY = {
    "num_workers": (
        "the loading processes are the rpcdl workers: their number is that of the worker addresses given to "
        "RPCDataset, and each worker runs up to its --parallel calls at once (rpcdl worker --parallel N)"
    ),
    "persistent_workers": "rpcdl workers always persist: they outlive epochs and loaders",
    "worker_init_fn": (
        "seed the workers' random generators with RPCDataloader(..., seed=S) (or rpcdl.set_random_seeds), "
        "and run any other set-up on the workers with rpcdl.rpc_sync(worker, fn) or in the dataset's __init__"
    ),
    "multiprocessing_context": "the workers are separate processes started by `rpcdl worker` or rpcdl.local_workers",
}


#: torch DataLoader arguments accepted with the one value that describes what rpcdl does anyway (configs
#: written for torch's DataLoader pass them): no loading processes in the trainer, workers that persist.
ACCEPTED = {"num_workers": 0, "persistent_workers": False}


def refuse_torch_only(options: dict[str, Any]) -> None:
    """Raise ``TypeError`` for the first of ``options``: what replaces it here when torch's DataLoader takes it.

    ``num_workers=0`` and ``persistent_workers=False`` pass (see :data:`ACCEPTED`); other values do not.
    """
    for name, value in options.items():
        if name in ACCEPTED and type(value) is type(ACCEPTED[name]) and value == ACCEPTED[name]:
            continue
        if name in TORCH_ONLY:
            accepted = f" (only {name}={ACCEPTED[name]!r} is accepted)" if name in ACCEPTED else ""
            raise TypeError(f"RPCDataloader does not take torch's {name}={value!r}{accepted}: {TORCH_ONLY[name]}")
        raise TypeError(f"RPCDataloader.__init__() got an unexpected keyword argument {name!r}")
