"""[WARM=20] [THREADS=2] python scripts/prototypes/heal_warmup.py CONVERTED_DIR

Prototype behind docs/conversion.md (the dense table's two 40-step heals). `revffn convert --heal-steps N` warms
its LR up over `training.export.heal_warmup` steps; until stop 54 that was a tenth: at 40 steps and lr 1e-4 on the
full-width calibrated SmolLM2, 4 steps, and the heal's KL rose to 2.46x its first value at step 2 (the floor of 20
steps came from this prototype; `--heal-warmup-steps` sets it on the command line). This reruns that heal
(the manual's pages, lr 1e-4, seed 0, no held-out measurements along it) from CONVERTED_DIR, the table's calibrated
row (`OUT/models/calibrated__full_width__pydoc_32k_` of `scripts/conversion_gap.py --model builtin:smollm2`), with a
warm-up of WARM steps, and prints the heal's KL list, its largest ÷ first and its last ten's mean.
"""
import json
import os
import sys

import torch

import revffn.training.export as export
from revffn.models.loading import load_hf


def main() -> None:
    converted, warm = sys.argv[1], int(os.environ.get("WARM", "20"))
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    manifest = json.loads(open(os.path.join(converted, "revffn.json")).read())
    spec = export.ConvertSpec(model=manifest["converted_from"], out="unused", heal_steps=40, heal_lr=1e-4,
                              heal_warmup_steps=warm,
                              heal_data="builtin:pydoc_calibration", stream_width="full", coupling="additive",
                              stream_dtype=manifest["stream_dtype"])
    torch.manual_seed(0)
    report = export.heal_converted(load_hf(converted), spec, log=lambda line: print(line, file=sys.stderr))
    print(json.dumps({"warmup_steps": warm, "kl_first": report["kl_first"], "kl_max": report["kl_max"],
                      "max_over_first": report["kl_max"] / report["kl_first"], "kl_last": report["kl_last"],
                      "kl": report["kl"], "wall_s": report["wall_s"]}))


if __name__ == "__main__":
    main()
