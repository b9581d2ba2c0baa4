"""A graph function of ours as one of Inductor's custom passes."""

from __future__ import annotations

import hashlib
import importlib

from torch._inductor.custom_graph_pass import CustomGraphPass


class InductorPass(CustomGraphPass):
    """Runs ``module.name(graph)`` (looked up at each call); Inductor's caches key it by the
    module's source file, so an edited pass never reuses graphs compiled by the old one."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, graph) -> None:
        getattr(importlib.import_module(self.module), self.name)(graph)

    def uuid(self) -> bytes:
        with open(importlib.import_module(self.module).__file__, "rb") as f:
            return hashlib.sha256(f.read()).digest()
