"""Reversible coupling math, the stack autograd Function, and routing/RNG/autocast replay."""

from revffn.reversible.coupling import RevBlock, RevStackFunction, StackContext, run_stack
from revffn.reversible.replay import AutocastState, RNGState, RouterTap

__all__ = ["RevBlock", "RevStackFunction", "StackContext", "run_stack", "AutocastState",
           "RNGState", "RouterTap"]
