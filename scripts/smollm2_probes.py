"""Write `builtin:smollm2_probes`: short factual questions that SmolLM2-135M-Instruct answers correctly.

    python scripts/smollm2_probes.py                          # the model from builtin:smollm2
    python scripts/smollm2_probes.py --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf   # or straight from the GGUF
    revffn eval builtin:smollm2 --data builtin:smollm2_probes --match contains --max-new-tokens 32

Knowledge probes for forgetting: a fine-tuned SmolLM2 that stops answering them has lost what the base
knew. `CANDIDATES` holds questions on geography, science, arithmetic and common facts, each with a short
reference answer. Every question is asked on its own (batch 1, no padding), as a single-turn chat through
the model's chat template, with greedy decoding of at most `MAX_NEW_TOKENS` tokens. It is kept when the
answer contains the reference, both whitespace-collapsed and lower-cased (`revffn eval --match contains`).
The kept ones become alpaca records (`instruction`, `output`) in revffn/assets/data/smollm2_probes.jsonl,
in `CANDIDATES` order, so the base scores ~100 % on them by construction. docs/smollm2_probes.json records
every candidate's answer, which were kept and how many.

Containment is lenient on short references: "27" is also contained in "127", "au" in "because". The
filter keeps only what the base got right, so this can only show as a fine-tuned model's false hits: the
arithmetic answers have two or more digits, no word reference is shorter than three letters, and
no reference occurs in its question (which an answer may repeat).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from revffn.data.formats import BUILTIN_DIR  # noqa: E402

OUT = BUILTIN_DIR / "smollm2_probes.jsonl"
REPORT = ROOT / "docs" / "smollm2_probes.json"
MAX_NEW_TOKENS = 32

# (category, question, reference). The reference is what a correct answer must contain.
CANDIDATES: tuple[tuple[str, str, str], ...] = tuple(
    (category, question, reference) for category, rows in {
        "geography": (
            ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
            ("What is the capital of Italy?", "Rome"), ("What is the capital of Germany?", "Berlin"),
            ("What is the capital of Spain?", "Madrid"), ("What is the capital of the United Kingdom?", "London"),
            ("What is the capital of Russia?", "Moscow"), ("What is the capital of China?", "Beijing"),
            ("What is the capital of Egypt?", "Cairo"), ("What is the capital of Canada?", "Ottawa"),
            ("What is the capital of Australia?", "Canberra"), ("What is the capital of India?", "New Delhi"),
            ("What is the capital of Greece?", "Athens"), ("What is the capital of Portugal?", "Lisbon"),
            ("What is the capital of Ireland?", "Dublin"), ("What is the capital of Norway?", "Oslo"),
            ("What is the capital of Sweden?", "Stockholm"), ("What is the capital of Poland?", "Warsaw"),
            ("What is the capital of Austria?", "Vienna"), ("What is the capital of Turkey?", "Ankara"),
            ("What is the capital of Kenya?", "Nairobi"), ("What is the capital of Argentina?", "Buenos Aires"),
            ("What is the capital of South Korea?", "Seoul"), ("What is the capital of Thailand?", "Bangkok"),
            ("What is the capital of the Netherlands?", "Amsterdam"),
            ("What is the capital of Belgium?", "Brussels"), ("What is the capital of Finland?", "Helsinki"),
            ("What is the capital of Denmark?", "Copenhagen"), ("What is the capital of Hungary?", "Budapest"),
            ("What is the capital of Peru?", "Lima"),
            ("What is the largest ocean on Earth?", "Pacific"),
            ("What is the longest river in Africa?", "Nile"),
            ("What is the tallest mountain in the world?", "Everest"),
            ("What is the largest hot desert in the world?", "Sahara"),
            ("On which continent is Egypt?", "Africa"),
            ("In which country is the Eiffel Tower?", "France"),
            ("In which city is the Statue of Liberty?", "New York"),
            ("What is the largest country in the world by area?", "Russia"),
            ("On which continent is the Amazon rainforest?", "South America"),
            ("In which country is the Great Wall?", "China"),
            ("In which city is Big Ben?", "London"),
            ("In which city is the Colosseum?", "Rome"),
            ("Which country is home to kangaroos?", "Australia"),
        ),
        "science": (
            ("What is the chemical formula of water?", "H2O"),
            ("Which planet is closest to the Sun?", "Mercury"),
            ("What is the largest planet in our solar system?", "Jupiter"),
            ("Which planet is known as the Red Planet?", "Mars"),
            ("Which gas do plants absorb from the air for photosynthesis?", "carbon dioxide"),
            ("Which gas do humans need to breathe to live?", "oxygen"),
            ("What is the powerhouse of the cell?", "mitochondria"),
            ("What force pulls objects toward the Earth?", "gravity"),
            ("What is the hardest natural substance?", "diamond"),
            ("What do bees make?", "honey"),
            ("What is the natural satellite of the Earth called?", "Moon"),
            ("What is the star at the center of our solar system?", "Sun"),
            ("Who developed the theory of relativity?", "Einstein"),
            ("Who discovered penicillin?", "Fleming"),
            ("Who proposed the theory of evolution by natural selection?", "Darwin"),
            ("Who formulated the three laws of motion?", "Newton"),
            ("What is the largest mammal?", "blue whale"),
            ("What is the fastest land animal?", "cheetah"),
            ("What is the tallest animal?", "giraffe"),
            ("At what temperature in degrees Celsius does water boil at sea level?", "100"),
            ("What is the largest organ of the human body?", "skin"),
            ("Which organ pumps blood through the body?", "heart"),
            ("What part of the plant makes food using sunlight?", "leaves"),
            ("What is the center of an atom called?", "nucleus"),
            ("What is the study of living things called?", "biology"),
            ("Which metal is liquid at room temperature?", "mercury"),
            ("What does DNA stand for?", "deoxyribonucleic acid"),
        ),
        "arithmetic": (
            ("What is 12 + 15?", "27"), ("What is 9 times 8?", "72"), ("What is 100 minus 37?", "63"),
            ("What is 6 times 7?", "42"), ("What is 50 divided by 5?", "10"), ("What is 25 + 25?", "50"),
            ("What is 11 times 11?", "121"), ("What is 144 divided by 6?", "24"),
            ("What is the square root of 144?", "12"), ("What is 20 + 30?", "50"),
            ("What is 7 times 8?", "56"), ("What is 1000 minus 1?", "999"), ("What is half of 50?", "25"),
            ("What is 10 times 10?", "100"), ("What is 15 + 17?", "32"), ("How many hours are in a day?", "24"),
            ("How many minutes are in an hour?", "60"), ("How many days are in a leap year?", "366"),
            ("How many days are in a week?", "seven"), ("How many continents are there?", "seven"),
        ),
        "common": (
            ("Who wrote Romeo and Juliet?", "Shakespeare"),
            ("Who painted the Mona Lisa?", "Leonardo da Vinci"),
            ("Who was the first person to walk on the Moon?", "Armstrong"),
            ("Who was the first president of the United States?", "George Washington"),
            ("What color is the sky on a clear day?", "blue"),
            ("What color is grass?", "green"),
            ("What color is a ripe banana?", "yellow"),
            ("What is the opposite of hot?", "cold"),
            ("What language is spoken in Brazil?", "Portuguese"),
            ("What language is spoken in Mexico?", "Spanish"),
            ("What language is spoken in France?", "French"),
            ("What is the currency of Japan?", "yen"),
            ("What is the currency of the United States?", "dollar"),
            ("What is the currency of the United Kingdom?", "pound"),
            ("Which animal is known as the king of the jungle?", "lion"),
            ("What is a baby cat called?", "kitten"),
            ("What is a baby dog called?", "puppy"),
            ("What is the first month of the year?", "January"),
            ("Which month comes after January?", "February"),
            ("Which day comes after Monday?", "Tuesday"),
            ("What is the plural of mouse?", "mice"),
            ("Who wrote the Harry Potter books?", "Rowling"),
            ("Who wrote the novel 1984?", "Orwell"),
            ("Who invented the telephone?", "Bell"),
            ("Which musical instrument has 88 keys?", "piano"),
            ("How many legs does a spider have?", "eight"),
            ("Which bird is a symbol of peace?", "dove"),
            ("What does CPU stand for?", "central processing unit"),
            ("What does HTML stand for?", "hypertext markup language"),
            ("What do cows produce that people drink?", "milk"),
            ("What is the primary language of the United States?", "English"),
        ),
    }.items() for question, reference in rows)


def _load(model: str, gguf: str | None):
    """(revffn CausalLM, tokenizer): from a GGUF file, or through `revffn eval`'s own loader."""
    if gguf is None:
        from revffn.cli import _load_for_cli  # exactly what `revffn eval MODEL` evaluates

        return _load_for_cli(model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from revffn.conversion.causal_lm import CausalLM

    path = Path(gguf)
    kw = {"gguf_file": path.name}
    tok = AutoTokenizer.from_pretrained(path.parent, **kw)
    tok.pad_token = tok.pad_token or tok.eos_token  # as revffn.data.tokenizer.load_tokenizer does
    hf = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    return CausalLM(hf).eval(), tok


def filter_probes(model, tokenizer, max_new_tokens: int = MAX_NEW_TOKENS) -> list[dict]:
    """Every candidate with the model's greedy answer (asked alone) and whether it contains the reference."""
    from revffn.data.templates import chat_prompts
    from revffn.models.generation import generate_texts
    from revffn.training.evaluate import is_match

    rows = []
    for category, question, reference in CANDIDATES:
        [answer] = generate_texts(model, tokenizer, chat_prompts([question], tokenizer), max_new_tokens, 1)
        rows.append({"category": category, "question": question, "reference": reference, "answer": answer,
                     "kept": is_match(answer, reference, "contains")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2", help="model reference, as for revffn eval")
    parser.add_argument("--gguf", default=None, help="read SmolLM2 from this GGUF file instead of --model")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--report", default=str(REPORT))
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = _load(args.model, args.gguf)
    rows = filter_probes(model, tok)
    kept = [r for r in rows if r["kept"]]
    Path(args.out).write_text("".join(json.dumps({"instruction": r["question"], "output": r["reference"]}) + "\n"
                                      for r in kept), encoding="utf-8")
    by_category = {}
    for r in rows:
        n_kept, n = by_category.get(r["category"], (0, 0))
        by_category[r["category"]] = (n_kept + r["kept"], n + 1)
    report = {"run_info": {"model": args.model if args.gguf is None else Path(args.gguf).name,
                           "command": "python scripts/smollm2_probes.py" + (f" --gguf {args.gguf}" * bool(args.gguf)),
                           "max_new_tokens": MAX_NEW_TOKENS, "match": "contains", "batch_size": 1},
              "meta_info": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": __import__("transformers").__version__},
              "n_candidates": len(rows), "n_kept": len(kept),
              "by_category": {c: {"kept": k, "candidates": n} for c, (k, n) in by_category.items()},
              "candidates": rows}
    Path(args.report).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"kept {len(kept)} of {len(rows)} candidates -> {args.out}; "
          + ", ".join(f"{c} {k}/{n}" for c, (k, n) in by_category.items()))


if __name__ == "__main__":
    main()
