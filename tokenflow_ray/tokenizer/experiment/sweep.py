"""The capacity experiment: is TF's gap to S (semantics) and to P (reconstruction) at K = 256 a capacity effect?

Per dataset (digits, shapes) and seed: one teacher, then for each K in the sweep the arms
  P      pixel-only index (w_sem = 0), K codes
  S      semantic-only index (w_dis = 0), K codes
  TF     the shared index (w = 1), K codes
  PxS    bits-matched factorised reference: independent semantic and pixel indices of sqrt(K) codes each, so a
         token carries log2 K bits like the others (its id is the pair); tests whether a joint K-way index beats
         splitting the same bits between two tables
Runs are appended to one JSON (`runs`: one row per dataset, seed, K, arm), so the sweep can be run in pieces that
each fit the box's time limit, and `summarize` aggregates whatever is there: mean and std over seeds per cell, and
the capacity verdict per dataset from the numbers (does the TF-S digit gap and the P-TF PSNR gap shrink as K grows,
by more than the seeds' spread?).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tokenflow_ray.tokenizer.experiment.arms import (
    ArmSpec,
    TrainSettings,
    arm_config,
    evaluate_arm,
    teacher_semantic_config,
    train_arm,
)
from tokenflow_ray.tokenizer.experiment.data import DATASETS, make_data
from tokenflow_ray.tokenizer.experiment.teacher import teacher_steps_for, train_teacher
from tokenflow_ray.torch_threads import torch_threads

SWEEP_ARMS = ("P", "S", "TF", "PxS")
METRICS = ("psnr", "ssim", "digit_acc", "color_acc", "digit_acc_emb", "usage", "perplexity", "nmi_digit",
           "nmi_color", "tokens_per_image", "seconds")


@dataclass(frozen=True)
class SweepConfig:
    dataset: str = "digits"
    seeds: tuple[int, ...] = (0, 1, 2)
    codebook_sizes: tuple[int, ...] = (256, 1024, 4096)
    arms: tuple[str, ...] = SWEEP_ARMS
    steps: int = 150  # tokenizer steps per arm (batch 64)
    teacher_steps: int | None = None  # None: the dataset's default (teacher.TEACHER_STEPS); rows record the number
    copies: int = 4  # colourings per source image
    side: int = 16
    threads: int = 1

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        bad = [a for a in self.arms if a not in SWEEP_ARMS]
        if bad:
            raise ValueError(f"unknown arms {bad}; choose from {SWEEP_ARMS}")
        for k in self.codebook_sizes:
            if k < 4 or math.isqrt(k) ** 2 != k:
                raise ValueError(f"codebook sizes must be perfect squares >= 4 (PxS uses sqrt(K)), got {k}")
        if min(self.steps, self.teacher_budget(), self.copies, self.threads) < 1 or not self.seeds:
            raise ValueError("steps, teacher_steps, copies, threads must be >= 1 and seeds non-empty")

    def teacher_budget(self) -> int:
        return teacher_steps_for(self.dataset, self.teacher_steps)


def _spec(arm: str) -> ArmSpec:
    return {"P": ArmSpec("P", w_sem=0.0), "S": ArmSpec("S", w_dis=0.0), "TF": ArmSpec("TF"),
            "PxS": ArmSpec("PxS", index_mode="separate")}[arm]


def run_sweep(cfg: SweepConfig, log=print, on_row=None) -> list[dict]:
    """Train and score every (seed, K, arm) at cfg.threads torch threads; returns one row per run (`on_row(row)`
    sees each as it is done, so a piece cut short by a time limit keeps what it finished)."""
    with torch_threads(cfg.threads):
        return _run_sweep(cfg, log, on_row)


def _run_sweep(cfg: SweepConfig, log, on_row) -> list[dict]:
    rows = []
    for seed in cfg.seeds:
        data = make_data(cfg.dataset, seed, copies=cfg.copies, side=cfg.side)
        teacher = train_teacher(teacher_semantic_config(cfg.side), data.a, data.c, cfg.teacher_budget(), seed)
        log(f"{cfg.dataset} seed {seed}: teacher class acc on C {teacher.acc_c:.3f} ({cfg.teacher_budget()} steps)")
        for k in cfg.codebook_sizes:
            for arm in cfg.arms:
                t0 = time.perf_counter()
                table = math.isqrt(k) if arm == "PxS" else k  # PxS: two tables of sqrt(K): log2 K bits a token
                model = train_arm(arm_config(_spec(arm), cfg.side, table, usage_window=8192), teacher.tower, data,
                                  TrainSettings(steps=cfg.steps), seed)
                m = evaluate_arm(model, data)
                m.pop("cluster_sizes")
                m["seconds"] = time.perf_counter() - t0
                m["bits_per_token"] = math.log2(k)
                rows.append({"dataset": cfg.dataset, "seed": seed, "k": k, "arm": arm, "teacher_acc": teacher.acc_c,
                             "teacher_steps": cfg.teacher_budget(),
                             **{key: float(v) for key, v in m.items()}})
                if on_row is not None:
                    on_row(rows[-1])
                log(f"{cfg.dataset} seed {seed} K {k:5d} {arm:4s} psnr {m['psnr']:.2f} class {m['digit_acc']:.3f} "
                    f"colour {m['color_acc']:.3f} usage {m['usage']:.3f} ({m['seconds']:.0f}s)")
    return rows


def append_runs(path: str | Path, rows: list[dict], cfg: SweepConfig) -> dict:
    """Merge rows into the JSON at path (a rerun of the same cell replaces it) and re-summarise."""
    file = Path(path)
    old = json.loads(file.read_text()) if file.is_file() else {"runs": [], "configs": []}
    key = lambda r: (r["dataset"], r["seed"], r["k"], r["arm"])  # noqa: E731
    merged = {key(r): r for r in old["runs"]}
    merged.update({key(r): r for r in rows})
    configs = old.get("configs", [])
    as_json = json.loads(json.dumps(asdict(cfg)))  # tuples -> lists, as the file holds them, so a rerun matches
    configs = configs if as_json in configs else configs + [as_json]
    result = {"runs": sorted(merged.values(), key=key), "configs": configs}
    result["summary"] = summarize(result["runs"])
    file.write_text(json.dumps(result, indent=2))
    return result


def summarize(runs: list[dict]) -> dict:
    cells: dict = {}
    for r in runs:
        cells.setdefault(r["dataset"], {}).setdefault(r["k"], {}).setdefault(r["arm"], []).append(r)
    out = {}
    for ds, by_k in cells.items():
        table, gaps = {}, {}
        for k, by_arm in sorted(by_k.items()):
            table[k] = {arm: {"seeds": len(rs), **{m: float(np.mean([r[m] for r in rs])) for m in METRICS},
                              "std": {m: float(np.std([r[m] for r in rs])) for m in METRICS}}
                        for arm, rs in by_arm.items()}
            if {"P", "S", "TF"} <= set(by_arm):
                per_seed = _paired_gaps(by_arm)
                gaps[k] = {name: {"mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v)}
                           for name, v in per_seed.items()}
        out[ds] = {"table": table, "gaps": gaps, "verdict": _verdict(gaps)}
    return out


def _paired_gaps(by_arm: dict) -> dict:
    """Per seed (paired: same data, same teacher): S - TF digit accuracy (points), P - TF PSNR (dB), and TF - PxS."""
    seeds = {a: {r["seed"]: r for r in rs} for a, rs in by_arm.items()}
    common = sorted(set(seeds["P"]) & set(seeds["S"]) & set(seeds["TF"]))
    out = {"s_minus_tf_class_pts": [100 * (seeds["S"][s]["digit_acc"] - seeds["TF"][s]["digit_acc"]) for s in common],
           "p_minus_tf_psnr_db": [seeds["P"][s]["psnr"] - seeds["TF"][s]["psnr"] for s in common]}
    if "PxS" in seeds:
        both = [s for s in common if s in seeds["PxS"]]
        out["tf_minus_pxs_class_pts"] = [100 * (seeds["TF"][s]["digit_acc"] - seeds["PxS"][s]["digit_acc"])
                                         for s in both]
        out["tf_minus_pxs_psnr_db"] = [seeds["TF"][s]["psnr"] - seeds["PxS"][s]["psnr"] for s in both]
    return out


def _verdict(gaps: dict) -> dict:
    """Capacity effect on a gap: it shrinks from the smallest to the largest K by more than twice the seeds' spread
    (std of the per-seed gap, larger of the two ends). Reported for both gaps; no thresholds are tuned on results."""
    ks = sorted(gaps)
    if len(ks) < 2:
        return {"note": "needs at least two codebook sizes"}
    lo, hi = gaps[ks[0]], gaps[ks[-1]]
    out = {"k_low": ks[0], "k_high": ks[-1]}
    for name in ("s_minus_tf_class_pts", "p_minus_tf_psnr_db"):
        shrink = lo[name]["mean"] - hi[name]["mean"]
        noise = 2 * max(lo[name]["std"], hi[name]["std"])
        out[name] = {"at_low_k": lo[name]["mean"], "at_high_k": hi[name]["mean"], "shrink": shrink,
                     "noise_2std": noise, "capacity_effect": bool(shrink > noise)}
    return out


def markdown(result: dict) -> str:
    lines = []
    for ds, s in result["summary"].items():
        lines += [f"**{ds}** (mean ± std over seeds; class = digit or shape probe on token ids, C split)", "",
                  "| K | arm | seeds | PSNR dB | SSIM | class (ids) | colour (ids) | class (emb) | usage |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k, arms in s["table"].items():
            for arm in SWEEP_ARMS:
                if arm not in arms:
                    continue
                m = arms[arm]
                cell = lambda key, d, m=m: f"{m[key]:.{d}f} ± {m['std'][key]:.{d}f}"  # noqa: E731
                lines.append(f"| {k} | {arm} | {m['seeds']} | {cell('psnr', 2)} | {cell('ssim', 3)} | "
                             f"{cell('digit_acc', 3)} | {cell('color_acc', 3)} | {cell('digit_acc_emb', 3)} | "
                             f"{cell('usage', 3)} |")
        lines += ["", "| K | S - TF class (pts) | P - TF PSNR (dB) | TF - PxS class (pts) | TF - PxS PSNR (dB) |",
                  "|---|---|---|---|---|"]
        for k, g in s["gaps"].items():
            f = lambda name, g=g: f"{g[name]['mean']:.2f} ± {g[name]['std']:.2f}" if name in g else "-"  # noqa: E731
            lines.append(f"| {k} | {f('s_minus_tf_class_pts')} | {f('p_minus_tf_psnr_db')} | "
                         f"{f('tf_minus_pxs_class_pts')} | {f('tf_minus_pxs_psnr_db')} |")
        lines += ["", f"verdict: `{json.dumps(s['verdict'])}`", ""]
    return "\n".join(lines)
