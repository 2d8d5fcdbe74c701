"""The bandwidth profile file: the PCIe and CPU expert rates the hybrid split is decided by.

`python -m freetoken bench bw` measures them (freetoken/bench/bw.py) and stores one profile
per GPU name and expert format in a JSON file, `{gpu: {expert_format: profile}}`, bytes per
second throughout; the engine reads the pair its q* split needs with `load_ratio`, for the
pool's format by its profile key (moe/profile_key.py). The engine imports this module, never the
measuring command.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_PROFILE_PATH = Path("~/.cache/freetoken/bw_profiles.json")
# Stated defaults when no profile was measured: a PCIe gen4/gen5 desktop link and a DDR5
# desktop's CPU expert rate. Run `python -m freetoken bench bw --format KEY` to replace them.
DEFAULT_PCIE_BPS = 25e9
DEFAULT_CPU_BPS = 50e9
NO_GPU = "none"  # the GPU name of a profile measured without CUDA


def save_profile(path: str | Path, profile: dict[str, Any]) -> Path:
    """Store `profile` under [gpu][expert_format] in the profile file (other entries kept)."""
    path = Path(path).expanduser()
    profiles = read_profiles(path)
    profiles.setdefault(profile["gpu"], {})[profile["expert_format"]] = profile
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profiles, indent=2))
    os.replace(tmp, path)  # readers never see half a file
    return path


def load_ratio(profile_path: str | Path | None, gpu_name: str, expert_format: str) -> tuple[float, float, str]:
    """(pcie_Bps, cpu_Bps, source): the bandwidths for the q* split on this GPU and format
    (`expert_format`: the pool's profile key, moe/profile_key.py).

    Prefers the concurrent pair (both paths running at once, as in a decode step); then the
    solo figures; whatever is missing falls back to DEFAULT_PCIE_BPS / DEFAULT_CPU_BPS, with a
    warning that says so. No other format's profile stands in for a missing one: the rates per
    byte differ by format. `source` says where the numbers came from."""
    path = _resolve(profile_path)
    measured = read_profiles(path).get(gpu_name, {})
    prof = measured.get(expert_format)
    if prof is None:
        others = f" (it has {', '.join(sorted(measured))} only)" if measured else ""
        source = (f"defaults (PCIe {DEFAULT_PCIE_BPS / 1e9:g} GB/s, CPU {DEFAULT_CPU_BPS / 1e9:g} GB/s): "
                  f"no {expert_format} profile for GPU {gpu_name!r} in {path}{others}")
        log.warning("bandwidth %s; run `python -m freetoken bench bw --format %s` to measure this machine",
                    source, expert_format)
        return DEFAULT_PCIE_BPS, DEFAULT_CPU_BPS, source
    where = f"{path} [{gpu_name}][{expert_format}], measured {prof.get('date', '?')}"
    conc = prof.get("concurrent") or {}
    if conc.get("pcie_fill_Bps") and conc.get("cpu_expert_Bps"):
        return float(conc["pcie_fill_Bps"]), float(conc["cpu_expert_Bps"]), f"concurrent pair from {where}"
    pcie, cpu = prof.get("pcie_fill_Bps"), prof.get("cpu_expert_Bps")
    parts = []
    if pcie:
        parts.append("PCIe solo")
    else:
        pcie = DEFAULT_PCIE_BPS
        parts.append(f"PCIe default {DEFAULT_PCIE_BPS / 1e9:g} GB/s (not measured)")
    if cpu:
        parts.append("CPU solo")
    else:
        cpu = DEFAULT_CPU_BPS
        parts.append(f"CPU default {DEFAULT_CPU_BPS / 1e9:g} GB/s (not measured)")
    source = f"{', '.join(parts)} from {where}"
    if "default" in source:
        log.warning("bandwidth: %s", source)
    return float(pcie), float(cpu), source


def solo_bandwidths(profile_path: str | Path | None, gpu_name: str, expert_format: str) -> tuple[float, float]:
    """(pcie_Bps, cpu_Bps) of each path running alone (a policy that uses only one of them);
    where the profile lacks one, the figure `load_ratio` would use."""
    prof = read_profiles(_resolve(profile_path)).get(gpu_name, {}).get(expert_format) or {}
    pair_pcie, pair_cpu, _ = load_ratio(profile_path, gpu_name, expert_format)
    return float(prof.get("pcie_fill_Bps") or pair_pcie), float(prof.get("cpu_expert_Bps") or pair_cpu)


def read_profiles(path: Path) -> dict[str, Any]:
    """The whole file, {gpu: {expert_format: profile}}; {} when missing or unreadable (warned)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("bandwidth profile file %s is unreadable (%s); ignoring it", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _resolve(profile_path: str | Path | None) -> Path:
    return Path(profile_path if profile_path is not None else DEFAULT_PROFILE_PATH).expanduser()
