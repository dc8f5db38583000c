"""`revffn doctor`: is this machine ready to train? The first thing to run on a new machine.

    revffn doctor --device cuda --output-dir runs --json

It rules out the environment before anything is blamed on the model or the config. Each check says
ok, what it measured, and when it fails, what to do:

    versions     torch, transformers, peft import and meet revffn's requirements; CUDA and driver versions
    device       the device asked for is visible (auto: CUDA when there is one, else the CPU)
    memory       free memory, checked by really allocating and writing a probe (default: 90 % of the
                 GPU's free memory; on the host 1 GiB, at most half of what is available)
    bf16         a bfloat16 matmul runs on the device and agrees with fp32 (native on the GPU: dtype auto uses it)
    reversible   a tiny reversible forward and backward equals its plain twin (`revffn check`: 2 layers, fp32)
    output_dir   free disk and write access where runs go (the nearest existing parent if it does not exist yet)

Exit code 0 when every check passes, 1 when one fails. With no device, the checks that need one fail
as not run.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

import psutil
import torch

from revffn.errors import UserError, one_line
from revffn.reports.check import TOL, run_check

PACKAGES = ("torch", "transformers", "peft")
MIN_FREE_DISK = 2**30  # below 1 GiB not even a small model's checkpoint fits
HOST_PROBE = 2**30


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check(name: str, ok: bool, detail: str, fix: str | None = None, **measured) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail, "fix": None if ok else fix, **measured}


def driver_version() -> str | None:
    """The NVIDIA driver's version (the kernel module's, else nvidia-smi's); None without one."""
    try:
        if m := re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text()):
            return m.group(1)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    return None


def check_versions() -> tuple[dict, dict]:
    """(versions, check): every package imports and meets revffn's requirement on it."""
    from packaging.requirements import Requirement

    try:
        wanted = {r.name: r for r in map(Requirement, metadata.requires("revffn") or []) if not r.marker}
    except metadata.PackageNotFoundError:  # run from a source tree without `pip install -e .`
        wanted = {}
    versions = {"python": platform.python_version(), "revffn": _version("revffn")}
    problems = []
    for name in PACKAGES:
        versions[name] = _version(name)
        req = wanted.get(name)
        if versions[name] is None:
            problems.append(f"{name} is not installed")
        elif req is not None and not req.specifier.contains(versions[name], prereleases=True):
            problems.append(f"{name} {versions[name]} does not meet {req}")
    versions.update(cuda=torch.version.cuda, driver=driver_version())
    detail = ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None)
    return versions, _check("versions", not problems, "; ".join(problems) or detail,
                            "pip install -e . in the revffn checkout (it installs what revffn needs)")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def list_devices() -> list[dict]:
    vm = psutil.virtual_memory()
    devices = [{"type": "cpu", "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                "memory_total_bytes": vm.total, "memory_available_bytes": vm.available}]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        devices.append({"type": "cuda", "index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                        "memory_total_bytes": p.total_memory})
    return devices


def check_device(want: str) -> tuple[torch.device | None, dict]:
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        note = "" if want == "cpu" else " (no CUDA device: training runs on the CPU)"
        return torch.device("cpu"), _check("device", True, f"cpu, {os.cpu_count()} cores{note}")
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        return None, _check("device", False, f"--device cuda: {why} (torch {torch.__version__})",
                            "install a torch built for your CUDA driver, check that nvidia-smi sees the GPU and "
                            "CUDA_VISIBLE_DEVICES does not hide it; or train on the CPU (--device cpu)")
    dev = torch.device("cuda", torch.cuda.current_device())
    return dev, _check("device", True, f"{dev}: {torch.cuda.get_device_name(dev)} ({torch.cuda.device_count()} "
                                       "visible)")


def check_memory(dev: torch.device, probe_mib: int | None) -> dict:
    """Free memory, and a probe of that size really allocated and written (pages committed)."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        probe = probe_mib * 2**20 if probe_mib else int(0.9 * free)
        where, fix = "on the GPU", "free the GPU (nvidia-smi lists the processes holding it), or a smaller --probe-mib"
    else:
        vm = psutil.virtual_memory()
        free, total = vm.available, vm.total
        probe = probe_mib * 2**20 if probe_mib else max(1, min(HOST_PROBE, free // 2))
        where, fix = "in host memory", "free host memory (or add swap), or a smaller --probe-mib"
    measured = {"free_bytes": free, "total_bytes": total, "probe_bytes": probe}
    if probe_mib and probe > free:  # on the host the kernel's OOM killer would end doctor, not an error it reports
        raise UserError(f"--probe-mib {probe_mib}: more than the {free // 2**20} MiB free {where} ({_gib(total)} in "
                        f"all). Fix: --probe-mib {max(1, free // 2**20 // 2)}, or drop it for the default.")
    try:
        x = torch.empty(probe, dtype=torch.uint8, device=dev)
        x.fill_(1)
        ok = int(x[-1]) == 1  # reading it back waits for the GPU's write
        del x  # frees the probe
    except (RuntimeError, MemoryError) as e:
        return _check("memory", False, f"could not allocate a {probe / 2**20:.0f} MiB probe {where} "
                      f"({one_line(e)[:200]}); {_gib(free)} free of {_gib(total)}", fix, **measured)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return _check("memory", ok, f"allocated and wrote a {probe / 2**20:.0f} MiB probe {where}; {_gib(free)} free of "
                  f"{_gib(total)}", fix, **measured)


def check_bf16(dev: torch.device) -> dict:
    """A bf16 matmul on the device agrees with fp32 to bf16's precision."""
    native = torch.cuda.is_bf16_supported(including_emulation=False) if dev.type == "cuda" else None
    try:
        a = torch.randn(64, 64, device=dev, generator=torch.Generator(dev).manual_seed(0))
        err = ((a.bfloat16() @ a.bfloat16()).float() - a @ a).norm().item() / (a @ a).norm().item()
    except RuntimeError as e:
        return _check("bf16", False, f"a bf16 matmul failed: {one_line(e)[:200]}",
                      "dtype=float32 (slower, more memory)", native=native)
    ok = err < 2e-2 and native is not False
    detail = f"bf16 matmul relative error {err:.1e} vs fp32" + ("" if native is None else
                                                                 f"; native bf16: {native}")
    return _check("bf16", ok, detail, "dtype=float32: this GPU has no native bf16 (compute capability < 8.0), "
                  "which dtype auto would use", relative_error=err, native=native)


def check_reversible(dev: torch.device) -> dict:
    """The engine on this machine: `revffn check` on a tiny model, reversible gradients vs the plain twin, for the
    default coupling (buffered: its rebuild must be bitwise, or training raises) and the additive one."""
    fix = ("the reversible backward is not exact here: rerun `revffn check --layers 2 --device cpu --json` (and with "
           "--coupling additive) and report both outputs; method=full or ckpt trains without it")
    runs = {}
    try:
        for coupling in ("buffered", "additive"):
            runs[coupling] = run_check("tiny-qwen2-moe", layers=2, dtype="float32", batch=2, seq=16,
                                       device=dev.type, coupling=coupling)
    except Exception as e:  # a broken install fails here rather than in the middle of a run
        return _check("reversible", False, f"revffn check ({coupling}) failed: {type(e).__name__}: {e}", fix)
    measured = {c: {k: r[k] for k in ("max_rel_grad_error", "max_reconstruction_error")} for c, r in runs.items()}
    worst = {k: max(m[k] for m in measured.values()) for k in ("max_rel_grad_error", "max_reconstruction_error")}
    ok = all(r["passed"] for r in runs.values()) and measured["buffered"]["max_reconstruction_error"] == 0
    detail = "; ".join(f"{c}: gradient error {m['max_rel_grad_error']:.1e}, reconstruction error "
                       f"{m['max_reconstruction_error']:.1e}" for c, m in measured.items())
    return _check("reversible", ok, f"{detail} vs the plain twin (tolerances {TOL['max_rel_grad_error']:g}, "
                  f"{TOL['max_reconstruction_error']:g}; buffered: bitwise)", fix, **worst, **measured)


def check_output_dir(output_dir: str) -> dict:
    """Free disk and a real write (created, flushed to disk, removed) where the runs will go."""
    path = Path(output_dir).absolute()
    target = next(p for p in [path, *path.parents] if p.exists())
    fix = "choose another --output-dir (output_dir= in the config), or fix its permissions or free disk space"
    if not target.is_dir():
        return _check("output_dir", False, f"{output_dir}: {target} is not a directory", fix, path=str(path))
    free = shutil.disk_usage(target).free
    measured = {"path": str(path), "checked_at": str(target), "free_bytes": free}
    try:
        fd, name = tempfile.mkstemp(dir=target, prefix=".revffn-doctor-")
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(2**20))
            f.flush()
            os.fsync(f.fileno())
        os.unlink(name)
    except OSError as e:
        return _check("output_dir", False, f"{target}: cannot write ({e.strerror})", fix, **measured)
    where = "" if target == path else f" (does not exist yet; checked {target})"
    largest = largest_checkpoint(path)
    need = max(MIN_FREE_DISK, 2 * largest)  # a checkpoint is written beside the previous one before it goes
    measured["largest_checkpoint_bytes"] = largest
    room = f"; the largest checkpoint there is {_gib(largest)}, and a save needs room for 2" if largest else ""
    return _check("output_dir", free >= need, f"{path}{where}: writable, {_gib(free)} free{room}", fix, **measured)


def largest_checkpoint(output_dir: Path) -> int:
    """The bytes of the largest checkpoint of the runs under `output_dir` (itself a run, or a folder of runs)."""
    dirs = [*output_dir.glob("checkpoints/step-*"), *output_dir.glob("*/checkpoints/step-*")]
    return max((sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in dirs if d.is_dir()), default=0)


def run_doctor(device: str = "auto", output_dir: str = "runs", probe_mib: int | None = None) -> dict:
    """Every check (see the module docstring); returns the report, `healthy` when every check passed."""
    versions, versions_check = check_versions()
    dev, device_check = check_device(device)
    checks = [versions_check, device_check]
    if dev is None:
        checks += [_check(name, False, "not run: no device", "fix the device check first")
                   for name in ("memory", "bf16", "reversible")]
    else:
        checks += [check_memory(dev, probe_mib), check_bf16(dev), check_reversible(dev)]
    checks.append(check_output_dir(output_dir))
    return {"healthy": all(c["ok"] for c in checks), "device": str(dev) if dev else None, "versions": versions,
            "devices": list_devices(), "checks": checks}


def format_doctor(report: dict) -> str:
    lines = [f"revffn doctor: device {report['device'] or 'none'}"]
    for c in report["checks"]:
        lines.append(f"  {'ok' if c['ok'] else 'FAIL':<5} {c['name']:<11} {c['detail']}"
                     + ("" if c["ok"] else f". Fix: {c['fix']}."))
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    lines.append("  healthy: every check passed" if not failed else f"  {len(failed)} check"
                 f"{'s' * (len(failed) > 1)} failed: {', '.join(failed)}")
    return "\n".join(lines)
