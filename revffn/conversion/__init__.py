"""Turning a pretrained HF causal LM into the model a method trains: the reversible conversion (`convert`),
its closed-form calibration (`calibrate`), the teacher and heal maths (`teacher`, `heal`), dense-to-MoE
upcycling (`upcycle`), the baselines' wrapper (`causal_lm`) and the loss every trained model shares (`loss`).

Nothing here reads a file or resolves a model reference: that is `revffn.models` (loading), one layer up.
Submodules are not imported here, so the package has no import-time side effects.
"""
