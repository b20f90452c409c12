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


def refuse_torch_only(options: dict[str, Any]) -> None:
    """Raise ``TypeError`` for the first of ``options``: what replaces it here when torch's DataLoader takes it."""
    for name in options:
        if name in TORCH_ONLY:
            raise TypeError(f"RPCDataloader does not take torch's {name}=: {TORCH_ONLY[name]}")
        raise TypeError(f"RPCDataloader.__init__() got an unexpected keyword argument {name!r}")
