"""Hardware profiles: unit counts, peak rates, memory and link figures, each with its source.

Profiles are YAML data files. The packaged ones live in ``scheduler/profiles/``; user
profiles (``megaloom calibrate`` writes ``cpu.yaml`` there) live in ``$MEGALOOM_PROFILE_DIR``
or else ``$XDG_CONFIG_HOME/megaloom/profiles`` (``~/.config/megaloom/profiles``) and take
precedence over packaged files of the same name.

Rates in the file are chip-wide datasheet figures (all units of an engine kind together).
A task runs on one unit, so the cost model charges it a fair share: :meth:`unit_peak` and
:meth:`unit_mem_bw` divide by the profile's unit count of that engine kind.

Layout (numbers may be written ``1.6e12``)::

    name: ascend-910b
    description: one line
    units: {cube: 24, vector: 48, comm: 4}
    peak:                      # chip-wide flop/s per engine kind and precision
      cube: {fp16: 3.76e14, bf16: 3.76e14, fp32: 9.4e13}
      vector: {fp32: 1.1e13, fp16: 2.2e13}
    mem_bw: 1.6e12             # B/s
    links:                     # alpha: latency (s), beta: bandwidth (B/s)
      intra: {alpha: 5.0e-6, beta: 3.92e11}
      inter: {alpha: 1.0e-5, beta: 2.5e10}
      host: {alpha: 5.0e-6, beta: 3.2e10}   # optional: host <-> device copies (PCIe)
    task_overhead: 2.0e-6      # s added to every task
    ops:                       # optional, written by `megaloom calibrate --from`: fitted per-op
      matmul: {throughput: 7.0e10, overhead: 1.2e-5, mem_bw: 1.0e30, samples: 32, median_rel_error: 0.04}
    contention:                # optional: engines sharing cores, comm slowing compute (scheduler.contention)
      cores: 2
      engines: [cube, vector, comm]
      overlap: 0.0
    device:                    # optional: how a profiler trace's deviceProperties name this chip
      names: [Ascend910B]      # any of these in the device name; else every fingerprint key equal
      fingerprint: {compute: "9.0", sms: 132, warp: 32}
    sources: {units: "...", peak.cube: "...", peak.vector: "...", mem_bw: "...",
              links.intra: "...", links.inter: "...", task_overhead: "..."}

A precision the engine has no figure for falls back along :data:`FALLBACK` (for example
``mxfp8`` on a chip without MX support runs at its ``fp8`` rate, else ``bf16``...), the
way a kernel library emulates a format with the next wider one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from megaloom.runtime.core import MAX_UNITS
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import load_yaml
from megaloom.runtime.plugins import Registry

FALLBACK: dict[str, tuple[str, ...]] = {
    "mxfp8": ("fp8", "bf16", "fp16", "fp32"), "fp8": ("bf16", "fp16", "fp32"), "bf16": ("fp16", "fp32"),
    "fp16": ("bf16", "fp32"), "fp64": ("fp32",), "fp32": ()}
FINGERPRINT_KEYS = ("compute", "sms", "warp")
OP_FIT_KEYS = ("throughput", "overhead", "mem_bw", "samples", "median_rel_error", "max_rel_error")
PACKAGED_DIR = Path(__file__).resolve().parent / "profiles"


def user_profile_dir() -> Path:
    """Where user profiles (calibrated ``cpu.yaml``) are read from and written to."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(os.environ.get("MEGALOOM_PROFILE_DIR") or Path(config) / "megaloom" / "profiles")


@dataclass(frozen=True, slots=True)
class Contention:
    """``engines`` share ``cores``; a compute task runs ``overlap`` slower while comm runs
    (:mod:`megaloom.scheduler.contention`)."""

    cores: float
    engines: tuple[str, ...] = ()
    overlap: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "engines": list(self.engines), "overlap": self.overlap}


@dataclass(slots=True)
class HardwareProfile:
    """One chip: engine units, chip-wide peak rates, memory and link figures, sources."""

    name: str
    units: dict[str, int]
    peaks: dict[str, dict[str, float]]
    mem_bw: float
    links: dict[str, tuple[float, float]]
    task_overhead: float
    sources: dict[str, str] = field(default_factory=dict)
    description: str = ""
    path: str = ""
    ops: dict[str, dict[str, float]] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    contention: Contention | None = None

    def peak(self, engine: str, precision: str = "fp32") -> float:
        """Chip-wide flop/s of ``engine`` at ``precision`` (with the documented fallback)."""
        if not (rates := self.peaks.get(engine)):
            raise ConfigError(f"profile {self.name!r} has no peak rates for engine {engine!r}")
        if precision not in FALLBACK:
            raise ConfigError(f"profile {self.name!r}: unknown precision {precision!r}; known: {', '.join(FALLBACK)}")
        for p in (precision, *FALLBACK[precision]):
            if p in rates:
                return rates[p]
        raise ConfigError(f"profile {self.name!r}: engine {engine!r} has no rate for {precision!r} "
                          f"nor its fallbacks {list(FALLBACK[precision])}")

    def unit_peak(self, engine: str, precision: str = "fp32") -> float:
        """flop/s one unit of ``engine`` gets: the chip-wide peak shared by its units."""
        return self.peak(engine, precision) / self.units.get(engine, 1)

    def unit_mem_bw(self, engine: str) -> float:
        """Memory bandwidth one unit of ``engine`` gets (fair share of ``mem_bw``)."""
        return self.mem_bw / self.units.get(engine, 1)

    def link(self, kind: str = "intra") -> tuple[float, float]:
        """``(alpha_s, beta_Bps)`` of the intra- or inter-node link."""
        if kind not in self.links:
            raise ConfigError(f"profile {self.name!r} has no link {kind!r}; it has {sorted(self.links)}")
        return self.links[kind]

    def to_dict(self) -> dict[str, Any]:
        """The YAML layout of this profile (what :func:`parse_profile` reads)."""
        return {"name": self.name, "description": self.description, "units": dict(self.units),
                "peak": {e: dict(r) for e, r in self.peaks.items()}, "mem_bw": self.mem_bw,
                "links": {k: {"alpha": a, "beta": b} for k, (a, b) in self.links.items()},
                "task_overhead": self.task_overhead, "sources": dict(self.sources),
                **({"ops": {k: dict(v) for k, v in self.ops.items()}} if self.ops else {}),
                **({"device": dict(self.device)} if self.device else {}),
                **({"contention": self.contention.to_dict()} if self.contention else {})}


def checked_units(units: Mapping[Any, Any], name: Callable[[str], str] = "units[{!r}]".format) -> dict[str, int]:
    """``units`` when every count is an integer from 1 to MAX_UNITS, else ConfigError naming
    ``name`` of its key."""
    for k, v in units.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_UNITS:
            raise ConfigError(f"{name(k)} must be a positive integer at most {MAX_UNITS}, got {v!r}")
    return {str(k): v for k, v in units.items()}


def _number(where: str, key: str, v: Any, *, positive: bool = True) -> float:
    try:  # YAML reads 1.6e12 as a string; a boolean is no number
        x = float(v if not isinstance(v, bool) else "")
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: key {key!r} must be a number, got {v!r}") from None
    if not (x == x and x != float("inf")) or x < 0 or (positive and x == 0):
        raise ConfigError(f"{where}: key {key!r} must be a {'positive' if positive else 'non-negative'} finite number, got {v!r}")
    return x


def _mapping(where: str, key: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or not v:
        raise ConfigError(f"{where}: key {key!r} must be a non-empty mapping, got {v!r:.60}")
    return v


def _known(where: str, key: str, v: Any, known: tuple[str, ...]) -> dict[str, Any]:
    """``v`` as a non-empty mapping with no fields but ``known``."""
    if unknown := sorted(set(_mapping(where, key, v)) - set(known)):
        raise ConfigError(f"{where}: key {key!r} has unknown fields {unknown}; known: {', '.join(known)}")
    return v


def parse_profile(data: Any, where: str) -> HardwareProfile:
    """Check a profile's dict form; a missing or bad figure raises ConfigError naming ``where`` and the key."""
    d = _mapping(where, "<top level>", data)
    for key in ("name", "units", "peak", "mem_bw", "links", "task_overhead", "sources"):
        if key not in d:
            raise ConfigError(f"{where}: missing key {key!r}")
    if not isinstance(d["name"], str) or not d["name"]:
        raise ConfigError(f"{where}: key 'name' must be a non-empty string")
    units = checked_units(_mapping(where, "units", d["units"]), lambda e: f"{where}: key 'units.{e}'")
    peak = _mapping(where, "peak", d["peak"])
    for e, rates in peak.items():
        if e not in units:
            raise ConfigError(f"{where}: key 'peak.{e}' names an engine missing from 'units'")
        if unknown := sorted(set(_mapping(where, f"peak.{e}", rates)) - set(FALLBACK)):
            raise ConfigError(f"{where}: key 'peak.{e}.{unknown[0]}' is not a known precision ({', '.join(FALLBACK)})")
    peaks = {e: {p: _number(where, f"peak.{e}.{p}", v) for p, v in rates.items()} for e, rates in peak.items()}
    links = {}
    given = _mapping(where, "links", d["links"])
    for k in ("intra", "inter", *(["host"] if "host" in given else [])):  # host <-> device copies: optional
        link = _mapping(where, f"links.{k}", given.get(k))
        for part in ("alpha", "beta"):
            if part not in link:
                raise ConfigError(f"{where}: missing key 'links.{k}.{part}'")
        links[k] = (_number(where, f"links.{k}.alpha", link["alpha"], positive=False),
                    _number(where, f"links.{k}.beta", link["beta"]))
    sources = _mapping(where, "sources", d["sources"])
    needed = ["units", *(f"peak.{e}" for e in peaks), "mem_bw", *(f"links.{k}" for k in links), "task_overhead",
              *(["contention"] if "contention" in d else [])]
    for key in needed:
        if not isinstance(sources.get(key), str) or not sources[key].strip():
            raise ConfigError(f"{where}: missing source text 'sources.{key}' (cite where the figure comes from)")
    ops = {str(op): {k: _number(where, f"ops.{op}.{k}", v, positive=k in ("throughput", "mem_bw"))
                     for k, v in _known(where, f"ops.{op}", fit, OP_FIT_KEYS).items()}
           for op, fit in (_mapping(where, "ops", d["ops"]) if "ops" in d else {}).items()}
    return HardwareProfile(
        name=d["name"], units=units, peaks=peaks, mem_bw=_number(where, "mem_bw", d["mem_bw"]), links=links,
        task_overhead=_number(where, "task_overhead", d["task_overhead"], positive=False),
        sources={str(k): str(v) for k, v in sources.items()}, description=str(d.get("description", "")),
        path=where, ops=ops, device=_device(where, d.get("device")),
        contention=_contention(where, d.get("contention"), units))


def _contention(where: str, c: Any, units: dict[str, int]) -> Contention | None:
    """The optional ``contention`` block: the ``cores`` its ``engines`` share, an ``overlap`` slowdown."""
    if c is None:
        return None
    c = _mapping(where, "contention", c)
    engines = c.get("engines", [])
    if set(c) - {"cores", "engines", "overlap"} or "cores" not in c or not set(engines) <= set(units):
        raise ConfigError(f"{where}: key 'contention' must hold cores, overlap and engines (a list of engine "
                          f"kinds of 'units'), got {c!r:.80}")
    return Contention(_number(where, "contention.cores", c["cores"]), tuple(engines),
                      _number(where, "contention.overlap", c.get("overlap", 0.0), positive=False))


def _device(where: str, v: Any) -> dict[str, Any]:
    """The optional ``device`` block: ``names`` (substrings) and a ``fingerprint``."""
    if v is None:
        return {}
    d = _known(where, "device", v, ("names", "fingerprint"))
    names = d.get("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: key 'device.names' must be a list of non-empty strings, got {names!r:.60}")
    fp = _known(where, "device.fingerprint", d["fingerprint"], FINGERPRINT_KEYS) if "fingerprint" in d else {}
    return {"names": list(names), **({"fingerprint": {k: str(x) for k, x in fp.items()}} if fp else {})}


def device_fingerprint(props: dict[str, Any]) -> dict[str, str]:
    """The fingerprint of a profiler trace's ``deviceProperties`` entry (compute capability, SMs, warp)."""
    ints = {k: v for k, v in props.items() if isinstance(v, int) and not isinstance(v, bool)}
    out = {key: str(ints[prop]) for key, prop in (("sms", "numSms"), ("warp", "warpSize")) if prop in ints}
    if "computeMajor" in ints and "computeMinor" in ints:
        out["compute"] = f"{ints['computeMajor']}.{ints['computeMinor']}"
    return out


def match_device(props: dict[str, Any]) -> HardwareProfile | None:
    """The profile of the device a trace's ``deviceProperties`` entry describes, or None.

    A profile whose ``device.names`` has a substring of the device's name wins (the longest
    one, so ``H800`` beats ``H100`` only in an H800's name); else the one profile whose
    whole fingerprint equals the device's; several or none: None.
    """
    name = str(props.get("name", "")).lower()
    fp = device_fingerprint(props)
    best, longest, by_fp = None, 0, []
    for n in list_profiles():
        try:
            p = load_profile(n)
        except ConfigError:
            continue  # a broken user profile does not hide the others
        if (hit := max((len(s) for s in p.device.get("names", []) if s.lower() in name), default=0)) > longest:
            best, longest = p, hit  # the first of equally long hits
        if (want := p.device.get("fingerprint")) and all(fp.get(k) == v for k, v in want.items()):
            by_fp.append(p)
    return best or (by_fp[0] if len(by_fp) == 1 else None)


def read_profile(path: str | os.PathLike) -> HardwareProfile:
    """Load one profile file; unreadable, non-YAML or incomplete files raise ConfigError."""
    where = os.fspath(path)
    return parse_profile(load_yaml(where, "profile"), where)


def profile_files() -> Registry[Path]:
    """Every profile file by name, read from the folders now: packaged files, replaced by
    user files of the same name."""
    files: Registry[Path] = Registry("hardware profile")
    for d in (PACKAGED_DIR, user_profile_dir()):
        for p in sorted(d.glob("*.yaml")):  # none from a folder that does not exist
            files.register(p.stem, p, replace=True)
    return files


def list_profiles() -> list[str]:
    """Names of every profile found (user profiles and packaged ones), sorted."""
    return profile_files().names()


def load_profile(name_or_path: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """A profile by name (user directory first, then packaged) or by path to a YAML file."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    s = os.fspath(name_or_path)
    return read_profile(s if s.endswith((".yaml", ".yml")) or os.sep in s else profile_files().get(s))
