"""A graph function of ours as one of Inductor's custom passes."""

from __future__ import annotations

import hashlib
import importlib

from amp_compiler.upstream.torch_private import private

# Modules defining ops amp's graphs call: Inductor writes a custom op's arguments, defaults
# included, into the code it caches, and keys the cache by the graph alone (an op whose
# schema changed was called from the disk cache with its old defaults, and refused them)
OP_MODULES = ("amp_compiler.loss_head.ops",)


class InductorPass(private("torch._inductor.custom_graph_pass.CustomGraphPass")):
    """Runs ``module.name(graph)`` (looked up at each call); Inductor's caches key it by the
    module's source file, graph_util's and those of amp's own ops, so an edited pass or op
    never reuses graphs compiled with the old one."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, graph) -> None:
        getattr(importlib.import_module(self.module), self.name)(graph)

    def uuid(self) -> bytes:
        from amp_compiler.passes import graph_util  # the helpers every pass imports

        digest = hashlib.sha256()
        ops = [importlib.import_module(name).__file__ for name in OP_MODULES]
        for path in (importlib.import_module(self.module).__file__, graph_util.__file__, *ops):
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.digest()


class InductorPasses(private("torch._inductor.custom_graph_pass.CustomGraphPass")):
    """Several passes as one: Inductor before 2.13 takes one custom pass per hook, not a list."""

    def __init__(self, *passes: InductorPass):
        self.passes = passes

    def __call__(self, graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        digest = hashlib.sha256()
        for p in self.passes:
            digest.update(p.uuid())
        return digest.digest()
