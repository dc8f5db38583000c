"""docs/memory.md's per-GPU memory table ("Per-GPU memory (revffn estimate)"), from the analytic estimate.

    python scripts/estimate_table.py            # print the table
    python scripts/estimate_table.py --readme   # and write it into docs/memory.md, under its heading

Every config-only preset (`revffn/models/geometries/`) x revffn and full (each with AdamW and Adafactor,
the optimizers FSDP training shards) and LoRA (AdamW only: its optimizer states are a small part of its
total) at the `revffn estimate` defaults (bf16, batch 1 x 2048 per GPU): GiB per GPU on one GPU and on 8
with FSDP, and the fewest 80GB GPUs FSDP fits on (`revffn.memory.estimate.gpus_needed`; -: not even
`MAX_GPUS`).
`tests/scripts/test_estimate_table.py` checks that docs/memory.md holds exactly this output.
"""

from __future__ import annotations

from pathlib import Path

from revffn.memory.estimate import estimate, gpus_needed
from revffn.methods import method_class
from revffn.models.loading import config_presets, hf_config

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Per-GPU memory (revffn estimate)"
VARIANTS = [("revffn", "adamw"), ("revffn", "adafactor"), ("full", "adamw"), ("full", "adafactor"),
            ("lora", "adamw")]
BATCH, SEQ, DTYPE, GPU_MEM, WORLD = 1, 2048, "bfloat16", "80GB", 8


def table() -> str:
    """The Markdown table, one row per preset x method x optimizer."""
    lines = [f"| model | method | optimizer | GiB, 1 GPU | GiB per GPU, {WORLD} GPUs fsdp | {GPU_MEM} GPUs (fsdp) |",
             "|---|---|---|---:|---:|---:|"]
    for name in config_presets():
        config = hf_config(name)
        for method_name, optimizer in VARIANTS:
            method = method_class(method_name)
            one, fsdp = (estimate(config, method, BATCH, SEQ, DTYPE, optimizer, world_size=n, distributed=d)["total"]
                         for n, d in ((1, "none"), (WORLD, "fsdp")))
            n = gpus_needed(config, method, BATCH, SEQ, DTYPE, GPU_MEM, optimizer=optimizer)
            lines.append(f"| {name} | {method_name} | {optimizer} | {one / 2**30:.1f} | {fsdp / 2**30:.1f} | "
                         f"{n or '-'} |")
    return "\n".join(lines) + "\n"


def write_readme(text: str, readme: Path = ROOT / "docs" / "memory.md") -> None:
    """Replace the table under `HEADING` (its first run of `|` lines) with `text`."""
    lines = readme.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == HEADING)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    last = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    readme.write_text("".join(lines[:first]) + text + "".join(lines[last:]))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="also write the table into docs/memory.md")
    args = parser.parse_args()
    out = table()
    print(out, end="")
    if args.readme:
        write_readme(out)
