"""Hugging Face Hub IDs as model references: `ORG/NAME` or `ORG/NAME@REVISION` (branch, tag or commit).

An ID resolves to a snapshot directory of huggingface_hub's cache, the one `from_pretrained` reads:
`HF_HUB_CACHE` (default `$HF_HOME/hub`). It downloads what is missing when the network is allowed;
with `HF_HUB_OFFLINE=1` it reads the cache without a single request. Everything after resolution sees
a plain local directory, so the rest of revffn knows only directories.

Only what revffn reads is fetched: configs and tokenizer files (`META_FILES`), plus the safetensors
weights when the model is loaded (`WEIGHT_FILES`), never a repository's other formats (Mixtral's also
holds 90 GiB of `consolidated.*.pt`).
"""

from __future__ import annotations

from pathlib import Path

from revffn.errors import UserError

META_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken"]  # config, generation config, tokenizer, weight index
WEIGHT_FILES = ["*.safetensors"]


def parse_hub_id(ref: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when `ref` is a well-formed Hub model ID `ORG/NAME[@REVISION]`, else None.

    A bare `NAME` (the Hub's legacy un-namespaced models) is not taken: it would shadow a mistyped preset.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, at, revision = ref.partition("@")
    if repo_id.count("/") != 1 or (at and not revision):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def patterns(weights: bool) -> list[str]:
    """The files revffn reads of a repository: configs and tokenizer, and the weights when it loads them."""
    return META_FILES + (WEIGHT_FILES if weights else [])


def download_command(ref: str, weights: bool = True) -> str:
    """The `hf download` line that fills the cache with what revffn reads of `ref`: with the weights, every
    command then runs offline; without, those that read only configs and tokenizer (`revffn estimate`)."""
    repo_id, revision = parse_hub_id(ref)
    return " ".join(["hf download", repo_id, *(["--revision", revision] if revision else []),
                     *(f"--include '{p}'" for p in patterns(weights))])


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


_RESOLVED: dict[tuple[str, str, bool], str] = {}  # (cache, ref, weights) -> its snapshot directory, once a process


def _local_hint(ref: str) -> str:
    """When `ref`'s first part is a local directory (`runs/typo` beside `runs/`), it was most likely meant as a path:
    what that directory holds, for the error that names `ref` as a Hub ID ("" otherwise)."""
    parent = Path(ref.split("@", 1)[0]).parent
    try:
        if not parent.is_dir():
            return ""
        held = sorted(p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:  # (an unreadable directory: no hint rather than a traceback in place of the error)
        return ""
    shown = ", ".join(held[:8]) + (", ..." if len(held) > 8 else "")
    return f"; as a path, there is no {ref!r} here: {parent}/ holds {shown or 'no directories'}"


def snapshot(ref: str, key: str = "model", weights: bool = True) -> str:
    """The cache directory of Hub ID `ref` (see the module docstring), downloading what is missing. Resolved
    once per process: the model, the converted-model check and the tokenizer of one run ask the Hub once (a
    snapshot with the weights also answers a later ask without them).

    Args:
        ref: `ORG/NAME` or `ORG/NAME@REVISION` (`parse_hub_id` accepts it).
        key: the config key or flag named in errors.
        weights: also fetch `*.safetensors` (False: configs and tokenizer only, e.g. for `revffn estimate`).

    Raises:
        UserError: naming `key`, when the ID is not cached and cannot be downloaded (offline, no network,
            not on the Hub, gated, unknown revision), each with the fix.
    """
    from huggingface_hub import constants, errors, snapshot_download

    repo_id, revision = parse_hub_id(ref)
    fetch = f"`{download_command(ref, weights)}`" + ("" if weights else " (what this command reads; add "
                                                      "--include '*.safetensors' for the commands that load it)")
    cache = constants.HF_HUB_CACHE
    for known in ((cache, ref, True), (cache, ref, weights)):
        if known in _RESOLVED and Path(_RESOLVED[known]).is_dir():
            return _RESOLVED[known]
    try:
        # offline: the cache only (huggingface_hub 1.x would still list a pinned commit's files online and fail)
        path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns(weights),
                                 local_files_only=constants.is_offline_mode())
        _RESOLVED[cache, ref, weights] = path
        return path
    except errors.LocalEntryNotFoundError as e:
        if isinstance(e, getattr(errors, "IncompleteSnapshotError", ())):  # huggingface_hub >= 2.4 tells
            raise UserError(f"{key}: the cached snapshot of {ref!r} in {cache} is incomplete ({_first_line(e)}). "
                            f"Fix: complete it with network: {fetch}.") from None
        why = ("HF_HUB_OFFLINE=1 forbids downloading it" if constants.is_offline_mode()
               else "the Hugging Face Hub could not be reached")
        hint = _local_hint(ref)  # (then most likely a path with a typo: that fix first)
        download = f"download it on a machine with network into that cache (HF_HUB_CACHE): {fetch}"
        raise UserError(f"{key}: {ref!r} is not in the Hugging Face cache ({cache}) and {why}{hint}. Fix: "
                        + (f"point {key} at an existing directory, or if {ref!r} is a Hub ID, {download}." if hint
                           else f"{download}; or point {key} at a local directory.")) from None
    except errors.GatedRepoError:
        raise UserError(f"{key}: {repo_id!r} is gated on the Hugging Face Hub and this token has no access. Fix: "
                        f"accept its conditions on https://huggingface.co/{repo_id}, then log in (`hf auth login` "
                        "or HF_TOKEN).") from None
    except errors.RepositoryNotFoundError:
        raise UserError(f"{key}: {ref!r} is neither a local directory nor a model on the Hugging Face Hub (or it "
                        f"is private){_local_hint(ref)}. Fix: check the ID (ORG/NAME as on huggingface.co), log in "
                        "for a private one (`hf auth login` or HF_TOKEN), or give a local directory.") from None
    except errors.RevisionNotFoundError:
        raise UserError(f"{key}: {repo_id!r} has no revision {revision!r} on the Hugging Face Hub. Fix: a branch, "
                        f"tag or commit of https://huggingface.co/{repo_id}, or drop @{revision}.") from None
    except Exception as e:  # the Hub failing mid-download (HTTP, transport), a full disk, ...
        raise UserError(f"{key}: fetching {ref!r} from the Hugging Face Hub failed ({_first_line(e)}). Fix: check "
                        f"the network and the free space of {cache}, then run again (finished files are "
                        "kept).") from None
