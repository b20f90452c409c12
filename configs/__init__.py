"""LightningCLI configurations shipped with rpcdl, installed as the package ``rpcdl.configs``.

Load one with ``importlib.resources.files("rpcdl.configs") / "digits.yaml"``.
"""
