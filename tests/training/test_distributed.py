"""Data-parallel training (`distributed: ddp | fsdp`, torchrun, gloo on CPU) equals one process on the
same global batch; the reversible stack stays exact under both; checkpoints resume after a rank is
killed and on another world size; a hung rank ends in a timeout error; bad input is refused before
anything is written.

The 2-rank runs train with per_device_train_batch_size 2; the reference, one process with 4: the same
global batch of every step. Losses per step and the final weights must agree within 1e-5 (fp32).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from revffn.errors import UserError
from revffn.training import loop
from revffn.training.config import load_config

REPO = Path(__file__).resolve().parents[2]
FAULT_RUN = Path(__file__).with_name("fault_run.py")
TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 2, hidden_size: 64}",
        "data=builtin:reversal_train", "eval_data=null", "max_steps=4", "logging_steps=1", "save_steps=0",
        "max_seq_length=32", "dtype=float32", "device=cpu", "learning_rate=1e-3", "warmup_steps=0",
        "adam_epsilon=1e-6"]  # AdamW's eps 1e-8 would amplify rounding in near-zero gradients to ~1e-5
ADDITIVE = ["method=revffn", "revffn.coupling=additive", "revffn.adapter_warmup_steps=2"]  # stage 1: 2 steps
METHODS = {  # name: (options, the reference's per_device_train_batch_size, gradient_accumulation_steps)
    # the router's load-balancing loss is a function of each rank's batch (as of each micro-batch):
    # equal to one process on the global batch without it ...
    "full": (["method=full", "router_aux_loss_coef=0"], 4, 1),
    # ... and with it, to one process accumulating the ranks' halves as micro-batches
    "full-aux": (["method=full"], 2, 2),
    "lora": (["method=lora"], 4, 1),
    # the buffered coupling (the default): fixed-point streams, the whole layer recomputed in backward, a
    # parameter's gradient accumulated once per chunk of sequences (16 tokens: every sequence its own chunk)
    "revffn-buffered": (["method=revffn", "revffn.coupling=buffered", "revffn.recompute_chunk_tokens=16"], 4, 1),
    # the additive coupling: the stage boundary (adapters only -> joint) at step 2, inside the run: DDP is re-wrapped
    "revffn": ([*ADDITIVE, "revffn.heal_data=task",
                "revffn.adapter_init=coordinate"], 4, 1),
    # the calibrated init, once per job: each rank fits its share of the rows, the fits' sums all-reduced
    "revffn-calibrated": ([*ADDITIVE, "revffn.heal_data=task",
                           "revffn.adapter_init=calibrated", "revffn.calibration_tokens=1024"], 4, 1),
    # the backward's chunked recompute (G by 16-token chunks, F by whole sequences): a parameter's gradient
    # accumulates once per chunk, and is reduced (ddp) or reduce-scattered (fsdp) once, when complete
    "revffn-chunked": ([*ADDITIVE, "revffn.heal_data=task",
                        "revffn.adapter_init=coordinate", "revffn.recompute_chunk_tokens=16"], 4, 1),
    # the heal (KL on text sampled from the model): every rank draws the global rows, trains on its share
    "revffn-heal": ([*ADDITIVE, "revffn.heal_data=self",
                     "revffn.adapter_init=coordinate"], 4, 1),
    # stage 2's distillation from the frozen copy, which FSDP shards like the student
    "revffn-distill": ([*ADDITIVE, "revffn.heal_data=task",
                        "revffn.adapter_init=coordinate", "revffn.distill_coef=0.5"], 4, 1),
    # stage 2's distillation from the cached teacher: each rank caches its share of the examples (a collective
    # forward under FSDP) and reads any of them back
    "revffn-distill-cached": ([*ADDITIVE, "revffn.heal_data=task",
                               "revffn.adapter_init=coordinate", "revffn.distill_coef=0.5",
                               "revffn.distill_teacher=cached"], 4, 1),
}
OTHERS = ["ckpt", "dora", "refta"]  # the remaining methods both strategies train (hift is refused): -m slow
# in -m slow too (the suite's 15-minute budget): the load-balancing loss per micro-batch, LoRA, the heal stage;
# full and revffn stay in the default tier
SLOW = {"full-aux", "lora", "revffn-heal", "revffn-distill", "revffn-distill-cached"}
STRATEGIES = ("ddp", "fsdp")
TOL = 1e-5  # AdamW at learning_rate 1e-3 moves every trained weight ~1e-3 a step: far beyond it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, over: list[str], launch: tuple[str, ...] = ("-m", "revffn", "train"),
              env: dict | None = None, restarts: int = 0) -> subprocess.CompletedProcess:
    """2 ranks on CPU (gloo); a hung collective would end at the subprocess timeout."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", f"--max-restarts={restarts}", *launch, *TINY, *over, f"output_dir={out}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return {f"{f.name}:{k}": v for f in sorted((run_dir / "final").glob("*.safetensors"))
            for k, v in load_file(f).items()}


def _assert_same_run(one: Path, other: Path, label: str) -> None:
    """The same losses at every step (each logged once) and the same final weights, within TOL."""
    one_losses, other_losses = _losses(one), _losses(other)
    assert len(other_losses) == len(one_losses) == 4  # rank 0 alone wrote metrics.jsonl: one line per step
    loss_diff = max(abs(a - b) for a, b in zip(one_losses, other_losses))
    one_w, other_w = _weights(one), _weights(other)
    assert one_w.keys() == other_w.keys() and one_w
    weight_diff = max((one_w[k] - other_w[k]).abs().max().item() for k in one_w)
    print(f"{label}: max |loss diff| {loss_diff:.2e}, max |weight diff| {weight_diff:.2e}")
    assert loss_diff < TOL and weight_diff < TOL


@pytest.mark.integration
@pytest.mark.parametrize("method", [*(pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in METHODS),
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in OTHERS)])
def test_data_parallel_equals_one_process(tmp_path, method):
    options, per_device, accumulation = METHODS.get(method, ([f"method={method}", "router_aux_loss_coef=0"], 4, 1))
    if method == "full":  # and the end-of-run exact match: by rank 0 under ddp, none under fsdp
        options = [*options, "eval_data=builtin:reversal_test", "eval_generate_limit=4", "eval_max_new_tokens=4"]
    loop.run(load_config(None, [*TINY, *options, f"per_device_train_batch_size={per_device}",
                                f"gradient_accumulation_steps={accumulation}", f"output_dir={tmp_path / 'one'}"]))
    for strategy in STRATEGIES:
        out = tmp_path / strategy
        r = _torchrun(out, [*options, "per_device_train_batch_size=2", f"distributed={strategy}", "save_steps=2"])
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.count("revffn train: done.") == 1  # rank 0 alone reports (the summary says which is main)
        if method == "revffn-buffered":  # a line every rank would say the same: once
            assert r.stderr.count("revffn: coupling buffered:") == 1, r.stderr[-3000:]
        ckpt = out / "checkpoints" / "step-2"  # rank 0's whole model (ddp), or every rank's shards (fsdp: DCP)
        assert (ckpt / ("dcp/.metadata" if strategy == "fsdp" else "model.safetensors")).is_file()
        _assert_same_run(tmp_path / "one", out, f"{method} {strategy}")
        if method == "full":
            scored = [line for line in (tmp_path / "one" / "report.md").read_text().splitlines()
                      if line.startswith("- final eval exact match: ") and line.endswith(" of the first 4 examples "
                                                                                        "(greedy)")]
            assert len(scored) == 1
            assert (scored[0] in (out / "report.md").read_text()) == (strategy == "ddp"), r.stdout[-2000:]
            assert ("eval exact match" in r.stdout) == (strategy == "ddp")
        if method.startswith("revffn"):
            stages = [json.loads(line)["stage"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            first = "joint" if method == "revffn-buffered" else "heal" if method == "revffn-heal" else "warmup"
            assert stages == [first] * 2 + ["joint"] * 2
        if method == "revffn-distill-cached":  # the 2-rank cache: one file per rank, every example once
            manifest = json.loads((out / "teacher_cache" / "manifest.json").read_text())
            assert manifest["world"] == 2 and manifest == {**json.loads(
                (tmp_path / "one" / "teacher_cache" / "manifest.json").read_text()), "world": 2}
        if method == "revffn-calibrated":  # each rank fitted half of the 8 rows of 128 tokens
            needle = "1024 tokens of builtin:stdlib_text (8 rows; this process fits rows "
            assert r.stderr.count(needle) == 2, r.stderr[-3000:]


@pytest.mark.integration
def test_a_streamed_run_resumes_each_rank_at_its_own_example(tmp_path):
    """`streaming: true` on 2 ranks: each reads its own shard of the stream, so each rank's place (examples read,
    packing carry) is saved, and a resume continues each from its own: the resumed steps' losses are the
    uninterrupted run's."""
    import shutil

    import datasets

    rows = [json.loads(line) for line in (REPO / "revffn/assets/data/reversal_train.jsonl").read_text().splitlines()]
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows[:200]).to_parquet(parquet)
    over = [f"data={parquet}", "streaming=true", "packing=true", "method=full", "router_aux_loss_coef=0",
            "per_device_train_batch_size=2", "distributed=ddp", "max_steps=6", "save_steps=3"]
    r = _torchrun(tmp_path / "ref", over)
    assert r.returncode == 0, r.stderr[-3000:]
    order = json.loads((tmp_path / "ref" / "checkpoints" / "step-3" / "trainer_state.json").read_text())["data_order"]
    assert len(order["ranks"]) == 2 and order["ranks"][0] != order["ranks"][1]  # two shards, two places
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    r = _torchrun(tmp_path / "run", [*over, "resume=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    ref, resumed = _losses(tmp_path / "ref"), _losses(tmp_path / "run")
    assert len(ref) == len(resumed) == 6
    assert max(abs(a - b) for a, b in zip(ref[3:], resumed[3:])) <= 1e-6, (ref, resumed)


@pytest.mark.integration
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("method", [pytest.param("full", marks=pytest.mark.slow), "revffn"])  # full: -m slow
def test_expert_without_tokens_on_one_rank(tmp_path, method, strategy):
    """Expert 0 of every layer gets no token on rank 1 (tests/training/starved_expert_run.py): the run
    neither hangs nor errors, and the ranks stay in step (rank 0 logged every step)."""
    count = tmp_path / "starved"
    r = _torchrun(tmp_path / "ddp", [*METHODS[method][0], "per_device_train_batch_size=2",
                                     f"distributed={strategy}", "max_steps=3"],
                  launch=(str(Path(__file__).with_name("starved_expert_run.py")),), env={"STARVED_OUT": str(count)})
    assert r.returncode == 0, r.stderr[-3000:]
    calls, tokens = map(int, count.read_text().split())
    assert calls > 0 and tokens == 0
    assert len(_losses(tmp_path / "ddp")) == 3


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])  # one code path
def test_a_resume_hashes_each_checkpoint_file_once_per_job(tmp_path, strategy):
    """Verification on resume runs after the process group is up: the ranks share the checkpoint's files, each
    hashed by one rank (tests/training/hash_count_run.py counts), and both resume from it."""
    over = [*METHODS["full"][0], "per_device_train_batch_size=2", f"distributed={strategy}", "save_steps=2"]
    out = tmp_path / "run"
    assert _torchrun(out, over).returncode == 0  # checkpoints/step-2
    files = json.loads((out / "checkpoints" / "step-2" / "manifest.json").read_text())["files"]
    hashed = tmp_path / "hashed"
    r = _torchrun(out, [*over, "resume=true"], launch=(str(Path(__file__).with_name("hash_count_run.py")),),
                  env={"HASH_OUT": str(hashed)})
    assert r.returncode == 0, r.stderr[-3000:]
    per_rank = [Path(f"{hashed}.{rank}").read_text().split() for rank in (0, 1)]
    assert all(per_rank) and sorted(sum(per_rank, [])) == sorted(str(out / "checkpoints" / "step-2" / f)
                                                                   for f in files), per_rank
    assert len(_losses(out)) == 4


def test_parameters_are_not_inputs_of_the_reversible_function():
    """The known-wrong DDP setup (every parameter an input of `RevStackFunction`: 'marked ready twice',
    or with static_graph silently wrong gradients) is not used: the Function's backward node has edges
    to the two streams and the anchor only, never to a parameter's AccumulateGrad."""
    from revffn.conversion.convert import convert
    from revffn.models.loading import load_hf

    torch.manual_seed(0)
    model = convert(load_hf("tiny-qwen2-moe", num_hidden_layers=2, hidden_size=64), adapter_init="coordinate")
    ids = torch.randint(0, 100, (2, 8))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, return_logits=False)
    params = {id(p) for p in model.parameters()}
    seen, stack, found = set(), [out.loss_sum.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "RevStackFunctionBackward":
            found.append(fn)
        stack += [f for f, _ in fn.next_functions]
    assert found, "the reversible stack did not run"
    for fn in found:
        assert len(fn.next_functions) == 3  # the tensor inputs: X_1, X_2 and the anchor
        leaves = [f.variable for f, _ in fn.next_functions if type(f).__name__ == "AccumulateGrad"]
        assert [v.numel() for v in leaves] == [0]  # the anchor alone
        assert not any(id(v) in params for v in leaves)


REVFFN = [*METHODS["revffn"][0], "router_aux_loss_coef=0"]  # no per-rank aux loss: any split of a batch is exact


@pytest.fixture(scope="module")
def revffn_one(tmp_path_factory) -> Path:
    """One process, the whole global batch of 4 a step: the reference of the fault and resume tests."""
    out = tmp_path_factory.mktemp("one") / "run"
    loop.run(load_config(None, [*TINY, *REVFFN, "per_device_train_batch_size=4", f"output_dir={out}"]))
    return out


@pytest.mark.integration
def test_rank_killed_mid_run_resumes_from_checkpoint(tmp_path, revffn_one):
    """torchrun --max-restarts 1: rank 1 is SIGKILLed after step 3 (step-2 is checkpointed, sharded).
    torchrun restarts both ranks, which resume from step-2 and finish: the run equals the uninterrupted
    one, metrics.jsonl holds each step once, and events.jsonl records the restart."""
    out = tmp_path / "fsdp"
    r = _torchrun(out, [*REVFFN, "per_device_train_batch_size=2", "distributed=fsdp", "save_steps=2"],
                  launch=(str(FAULT_RUN), "kill@step:3:1"), restarts=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "-9" in r.stderr or "SIGKILL" in r.stderr  # the agent saw rank 1 die
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"], e["from_step"]) for e in events if e["event"] != "load"] == [("restart", 1, 2)]
    _assert_same_run(revffn_one, out, "killed rank, resumed")


@pytest.mark.integration
def test_resume_on_one_process_from_two_ranks(tmp_path, revffn_one):
    """A sharded checkpoint taken at world size 2 resumes in one process: with global_batch_size the
    global batch stays 4 (2 ranks x 2, then 1 process x 2 x 2 accumulated), so the data order and the
    result are the uninterrupted run's."""
    out = tmp_path / "run"
    batch = ["per_device_train_batch_size=2", "global_batch_size=4"]
    r = _torchrun(out, [*REVFFN, *batch, "distributed=fsdp", "save_steps=2"], launch=(str(FAULT_RUN), "raise@step:3"))
    assert r.returncode != 0 and (out / "checkpoints" / "step-2" / "dcp").is_dir()
    loop.run(load_config(None, [*TINY, *REVFFN, *batch, "resume=true", f"output_dir={out}"]))
    _assert_same_run(revffn_one, out, "world 2 -> 1")


@pytest.mark.integration
def test_hung_rank_ends_in_a_timeout_error(tmp_path):
    """Rank 1 hangs after step 2; rank 0's next collective gives up after distributed_timeout and the
    job ends with a message naming the key, instead of hanging."""
    t0 = time.monotonic()
    r = _torchrun(tmp_path / "run", ["method=full", "per_device_train_batch_size=2", "distributed=ddp",
                                     "distributed_timeout=5"], launch=(str(FAULT_RUN), "hang@step:2:1"))
    assert r.returncode != 0
    assert "CollectiveTimeout" in r.stderr and "distributed_timeout=5s" in r.stderr
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("over, env, needle", [
    (["distributed=ddp"], {}, "distributed: ddp needs the processes torchrun starts"),
    (["distributed=ddp", "method=hift"], {"RANK": "0", "WORLD_SIZE": "2"}, "cannot train method 'hift'"),
    (["distributed=auto", "method=hift"], {"RANK": "0", "WORLD_SIZE": "2"}, "cannot train method 'hift'"),
    (["distributed=ddp", "optimizer_in_backward=true"], {"RANK": "0", "WORLD_SIZE": "2"}, "optimizer_in_backward"),
    (["distributed=ddp", "max_restarts=1"], {"RANK": "0", "WORLD_SIZE": "2"}, "max_restarts"),
    (["distributed=none"], {"RANK": "0", "WORLD_SIZE": "2"}, "distributed: none"),
    (["distributed=fsdp"], {}, "distributed: fsdp needs the processes torchrun starts"),
    (["distributed=fsdp", "method=hift"], {"RANK": "0", "WORLD_SIZE": "2"}, "cannot train method 'hift'"),
    (["distributed=fsdp", "optimizer=adamw8bit"], {"RANK": "0", "WORLD_SIZE": "2"}, "optimizer=adamw8bit"),
    (["distributed=ddp", "optimizer_offload=cpu"], {"RANK": "0", "WORLD_SIZE": "2"}, "optimizer_offload: cpu"),
    (["distributed=ddp", "global_batch_size=6", "per_device_train_batch_size=2"], {"RANK": "0", "WORLD_SIZE": "4"},
     "global_batch_size: 6 is not a multiple of per_device_train_batch_size 2 x 4 processes"),
    (["global_batch_size=8", "gradient_accumulation_steps=2"], {}, "both set the batch"),
])
def test_bad_input(tmp_path, monkeypatch, over, env, needle):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="Fix:") as e:
        loop.run(load_config(None, [*TINY, "method=full", *over, f"output_dir={out}"]))
    assert needle in str(e.value)
    assert not out.exists()
    assert not torch.distributed.is_initialized()


def test_unknown_strategy_is_a_config_error():
    with pytest.raises(UserError, match="distributed"):
        load_config(None, [*TINY, "method=full", "distributed=deepspeed", "output_dir=x"])


@pytest.mark.integration
def test_cli_exit_2_without_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "revffn", "train", *TINY, "method=full", "distributed=ddp",
                        f"output_dir={tmp_path / 'run'}"], env={**env, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "torchrun" in r.stderr
    assert not (tmp_path / "run").exists()


def test_fsdp_refuses_to_resume_a_whole_model_checkpoint(tmp_path, monkeypatch):
    """A checkpoint of a run without FSDP (model.safetensors) is not resumed under fsdp; the run's files
    stay as they were."""
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):  # a one-process run with step-2 saved, stopped at step 3
        loop.run(load_config(None, [*TINY, "method=full", "save_steps=2", f"output_dir={out}"]),
                 fault=lambda point, step, restart: (_ for _ in ()).throw(RuntimeError("stop")) if step == 3 else None)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="distributed=ddp or none"):
        loop.run(load_config(None, [*TINY, "method=full", "distributed=fsdp", "resume=true", f"output_dir={out}"]))
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_fsdp_shards_the_distillation_teacher_copy_like_the_model(tmp_path):
    """`distill_coef` with the copy route under FSDP: the teacher's parameters are shards (DTensors), as the
    student's, not a whole copy per rank (a one-process gloo group is enough to see the placement)."""
    from torch.distributed.tensor import DTensor

    from revffn.training.step import build_run

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = load_config(None, [*TINY, *METHODS["revffn-distill"][0], f"output_dir={tmp_path / 'run'}"])
        run = build_run(cfg, torch.device("cpu"), strategy="fsdp")
        teacher = run.method.teacher
        assert teacher is not None and teacher is not run.model
        assert all(isinstance(p, DTensor) for p in teacher.parameters())
        assert all(isinstance(p, DTensor) for p in run.model.parameters())
    finally:
        torch.distributed.destroy_process_group()


def test_validate_under_torchrun_checks_every_rank_and_says_it_once(tmp_path):
    proc = _torchrun(tmp_path / "run", ["distributed=fsdp"], launch=("-m", "revffn", "validate", ""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("config OK") == 1 and "distributed=fsdp: checked on each of 2 processes" in proc.stdout
