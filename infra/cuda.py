"""Whether a GPU run can start on this machine, and if not, why, in one line (DESIGN.md section 10).

A run set up for GPUs (bf16, DeepSpeed, or `require_cuda`) on a machine where torch sees no CUDA
device would otherwise build a CPU accelerator and stop on something unrelated (the CPU's pinned
numerics) or train for days on the CPU. The usual cause on a cluster is the driver: a torch wheel
built for CUDA 13 needs an NVIDIA driver of the R580 series or newer (NVIDIA's minor-version
compatibility: CUDA 13.x >= 580, 12.x >= 525, 11.x >= 450), and many H100 nodes run R535-R570.

  python -m infra.cuda     # what torch and the driver are, and whether a GPU run can start (exit 1)

It reads torch's build and the driver's version; it loads no model and knows nothing of runs.
"""
import os
import re
import shutil
import subprocess
import sys

# CUDA major version of a torch build -> the oldest driver branch that runs it (NVIDIA, "CUDA
# Compatibility": minor version compatibility, Table 1)
DRIVER_FLOOR = {11: 450, 12: 525, 13: 580}
FIX = ("update the NVIDIA driver, or install a torch build for the CUDA it has "
       "(requirements-gpu.txt says how)")


def driver_version() -> str:
    """The NVIDIA kernel driver's version ("570.133.20"), or '' when none is loaded."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            found = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", f.read())
        if found:
            return found[1]
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.split()
            return out[0] if out else ""
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return ""


def problem(torch_cuda, driver: str, available: bool, init_error: str = "") -> str:
    """Why a GPU run cannot start, or '' when it can. torch_cuda: torch.version.cuda ("13.0", or
    None for a CPU build); driver: driver_version(); available: torch.cuda.is_available();
    init_error: what initialising CUDA raised, if anything."""
    if available:
        return ""
    if torch_cuda is None:
        return (f"torch is a CPU build, without CUDA (NVIDIA driver: {driver or 'none found'}): "
                "pip install -r requirements-gpu.txt, or make install-gpu")
    major = int(str(torch_cuda).split(".")[0])
    floor = DRIVER_FLOOR.get(major)
    need = f"CUDA {torch_cuda} needs an NVIDIA driver >= {floor}" if floor else f"CUDA {torch_cuda}"
    if not driver:
        return (f"no NVIDIA driver found (no /proc/driver/nvidia/version, no nvidia-smi): torch's "
                f"{need}; is this a GPU node?")
    if floor and int(driver.split(".")[0]) < floor:
        return f"NVIDIA driver {driver} is too old: torch's {need}: {FIX}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (f"torch ({need}) sees no CUDA device with driver {driver}{hint}"
            + (f": {init_error}" if init_error else ""))


def diagnose() -> str:
    """problem() for this machine."""
    import torch
    init_error = ""
    available = torch.cuda.is_available()
    if not available and torch.version.cuda is not None:
        try:
            torch.cuda.init()
        except Exception as e:  # the driver's own words: "found no NVIDIA driver", "too old", ...
            init_error = str(e).splitlines()[0] if str(e) else type(e).__name__
    return problem(torch.version.cuda, driver_version(), available, init_error)


def wanted(cfg) -> str:
    """Why cfg is a GPU run ('' if it is not): bf16, DeepSpeed under accelerate, or require_cuda."""
    if getattr(cfg, "require_cuda", False):
        return "require_cuda = true"
    if getattr(cfg, "bf16", False):
        return "bf16 = true"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        return "DeepSpeed (accelerate's config)"
    return ""


def require(cfg):
    """Stop (ValueError) in seconds when cfg is a GPU run and no CUDA device can be used here."""
    why = wanted(cfg)
    if why and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true"):
        found = diagnose()
        if found:
            raise ValueError(f"this run needs a CUDA GPU ({why}): {found}; on a CPU, pass "
                             "--bf16=false without DeepSpeed (or ACCELERATE_USE_CPU=true for bf16 "
                             "on the CPU)")


def main(argv=None) -> int:
    import argparse
    argparse.ArgumentParser(prog="python -m infra.cuda", description="Whether a GPU run can start "
                            "here: torch's CUDA, the NVIDIA driver (exit status 1 if not)."
                            ).parse_args(argv)
    import torch
    found = diagnose()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda or '- (CPU build)'}; NVIDIA driver "
          f"{driver_version() or '- (none found)'}; "
          + (f"{torch.cuda.device_count()} CUDA device(s): a GPU run can start" if not found
             else f"no GPU run can start: {found}"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
