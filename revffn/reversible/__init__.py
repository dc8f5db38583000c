"""Reversible coupling math, the stack autograd Function, and choice/RNG/autocast replay."""

from revffn.reversible.coupling import RevBlock, RevStackFunction, StackContext, run_stack
from revffn.reversible.replay import (
    AutocastState,
    RNGState,
    RouterTap,
    SubBlockRecord,
    recording_choices,
    replaying_choices,
)

__all__ = ["RevBlock", "RevStackFunction", "StackContext", "run_stack", "AutocastState", "RNGState", "RouterTap",
           "SubBlockRecord", "recording_choices", "replaying_choices"]
