"""Checks run on a rewritten graph beside the pipeline: they change nothing, they refuse.

``check_gradient_flow``: every input that got a gradient in the program as written gets one
in the rewritten program (a cast placed on a parameter's path must not detach it).
"""

from .gradient_flow import check_gradient_flow

__all__ = ["check_gradient_flow"]
