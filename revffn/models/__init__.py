"""HF architectures (`architectures`, one spec file each), references and loading (`loading`),
the RevFFN converter (`convert`), the baselines' wrapper (`causal_lm`), losses and generation.

Submodules are not imported here, so the package has no import-time side effects.
"""
