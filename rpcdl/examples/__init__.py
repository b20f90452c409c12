"""Example datasets and models used by ``rpcdl demo`` and the configs."""
