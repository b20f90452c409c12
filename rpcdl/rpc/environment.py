"""Environment variables a call reads, asked about together.

A call reads a few variables (credentials and limits) that are usually not
set; :class:`Variables` says whether any of them is, and the callers read the
values only when one is. It asks ``os.environ`` every time, so a change of the
environment mid-process is seen by the next call.

Threading model: reads only; ``os.environ`` is read under the GIL.
"""

from __future__ import annotations

import os


class Variables:
    """A few environment variables, asked about together.

    Args:
        names: the variables.

    Example::

        >>> Variables("RPCDL_SURELY_NOT_SET").unset()
        True
    """

    def __init__(self, *names: str) -> None:
        self.names = names

    def unset(self) -> bool:
        """Whether none of the variables is set (an empty value counts as set)."""
        get = os.environ.get
        return all(get(name) is None for name in self.names)
