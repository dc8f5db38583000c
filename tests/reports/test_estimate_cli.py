"""`revffn estimate`: a readable breakdown, one JSON object, exit 2 on bad input."""

import json

import pytest

from revffn import cli


def test_prints_a_breakdown(capsys):
    assert cli.main(["estimate", "--model", "qwen1.5-moe-a2.7b", "--method", "revffn", "--batch", "8",
                     "--seq", "2048", "--gpu-mem", "80GB"]) == 0
    out = capsys.readouterr().out
    for word in ("memory estimate", "weights", "optimizer_states", "activations", "total",
                 "fits on this GPU (80GB): no"):
        assert word in out, word
    assert "routing records" not in out  # the buffered default rebuilds bitwise: it records no choices
    assert cli.main(["estimate", "--model", "qwen1.5-moe-a2.7b", "--method", "revffn", "--batch", "8",
                     "--seq", "2048", "--option", "coupling=additive"]) == 0
    assert "routing records" in capsys.readouterr().out  # the additive coupling's top-k indices


def test_json_is_one_object(capsys):
    assert cli.main(["estimate", "--model", "tiny-olmoe", "--method", "lora", "--batch", "2", "--seq", "64",
                     "--dtype", "float32", "--option", "r=8", "--gpu-mem", "1GiB", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["method"] == "lora" and est["fits"] is True and est["gpu_mem"] == "1GiB"
    assert est["total"] == sum(est[k] for k in ("weights", "grads", "optimizer_states", "activations", "logits",
                                                "overhead"))


def test_layers_and_hidden_overrides_scale_the_estimate(capsys):
    def total(*extra):
        assert cli.main(["estimate", "--model", "qwen1.5-moe-a2.7b", "--method", "full", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["total"]

    assert total("--layers", "4") < total("--layers", "8") < total()
    assert total("--layers", "4", "--hidden", "1024") < total("--layers", "4")


@pytest.mark.parametrize("argv,word", [(["--gpu-mem", "80"], "--gpu-mem"), (["--gpu-mem", "lots"], "--gpu-mem"),
                                       (["--model", "qwen1.5-moe"], "qwen1.5-moe-a2.7b"),
                                       (["--method", "fulll"], "full"), (["--option", "rank=4"], "rank"),
                                       (["--dtype", "float8"], "dtype"),
                                       (["--method", "revffn", "--option", "stage=3"], "option stage: must be <= 2"),
                                       (["--method", "hift", "--option", "group_size=0"], "group_size"),
                                       (["--distributed", "zero"], "--distributed"),
                                       (["--distributed", "ddp", "--option", "optimizer_in_backward=true"],
                                        "optimizer_in_backward")])
def test_bad_input_exit_2(argv, word, capsys):
    base = {"--model": "tiny-qwen2-moe", "--method": "full"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    assert cli.main(["estimate", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert word in err and err.count("\n") == 1


def test_fsdp_per_gpu_and_the_gpus_needed(capsys):
    argv = ["estimate", "--model", "mixtral-8x7b", "--distributed", "fsdp", "--world-size", "8", "--gpu-mem", "80GB",
            "--option", "coupling=additive"]  # (the buffered coupling, no adapters: 6 whatever the options below)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for word in ("per GPU (distributed fsdp, world size 8)", "gathered_params", "unsharded_grads",
                 "fsdp: fits on 6 or more GPUs of 80GB", "GPUs"):
        assert word in out, word
    # full-width streams (the default): 6 GPUs; with the adapters trained in stage 2, 6 with P_down folded into the
    # layers (the default), 7 without (frozen, an unfolded P_down has no gradient or optimizer state)
    trained = ["--option", "train_adapters=true"]
    for option, gpus in (([], 6), (["--option", "fold_adapters=false"], 6), (trained, 6),
                         ([*trained, "--option", "fold_adapters=false"], 7)):
        assert cli.main([*argv, *option, "--json"]) == 0
        est = json.loads(capsys.readouterr().out)
        assert (est["world_size"], est["distributed"], est["gpus_needed"]) == (8, "fsdp", gpus)
        assert {r["optimizer"]: r["gpus"] for r in est["configurations"] if r["offload"] == "none"}["adamw"] == gpus
