"""Data: dataset files, chat templates, tokenisation, batching, the shipped tokenizer and task data.

* `formats.load_examples`   - JSON/JSONL/builtin datasets, and tables through `datasets` (`tables`:
                                hf:NAME, save_to_disk directories, parquet/arrow/csv) -> normalised chat examples
* `templates.render_segments`, `templates.render_prompt` - examples -> text, with the loss mask
* `collate.tokenize_dataset`, `collate.collate`, `collate.DataOrder` - tokens, batches, resumable order
* `tokenizer.load_tokenizer` - the shipped BPE tokenizer or a local one
* `tasks`, `corpus` - synthetic task generators and the offline stdlib-docstring corpus

Submodules are not imported here, so `import revffn.data` stays cheap.
"""

# the calibrated init's default text: real text (the standard library's docstrings, shipped), which keeps a real model
# better than text sampled from it (SmolLM2: +1.81 nats against +2.40 on `self`, docs/conversion.md)
DEFAULT_CALIBRATION = "builtin:stdlib_text"
