"""One workload's measurements: times per verified runner, speedups, GFLOP/s, the rest."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from fusion.bench.runners import (
    FUSED,
    NATIVE,
    ORT_ALL,
    ORT_FUSED,
    ORT_NONE,
    RunnerInfo,
    runner_label,
)
from fusion.bench.timing import Timing


@dataclass
class BenchResult:
    workload: str
    description: str
    threads: int
    fused: dict[str, int]  # fused nodes per rule
    flops: int  # of the original model, per run
    timing: Timing  # seconds per call, per verified runner
    runners: dict[str, RunnerInfo]
    sgemm: dict = field(default_factory=dict)  # shape [M, K, N], median/min/max s, gflops
    profile: dict = field(default_factory=dict)  # kernel/island/between seconds
    compile: dict = field(default_factory=dict)  # cold/cached seconds, or a note
    notes: list[str] = field(default_factory=list)
    batch: int = 1  # items per run: throughput = batch / median
    nodes: list[dict] = field(default_factory=list)  # each fused node alone vs its body
    conv: dict = field(default_factory=dict)  # conv and all counted FLOPs, the kernels' shares
    traffic: dict = field(default_factory=dict)  # depth-first blocks' bytes: fusion.bench.traffic

    @property
    def mode(self) -> str:
        return self.timing.mode

    @property
    def slower_nodes(self) -> list[dict]:
        """Fused nodes slower than onnxruntime running their own function body."""
        return [n for n in self.nodes if n["slower"]]

    def throughput(self, name: str) -> float | None:
        """Items per second at the median: batch / median seconds per run."""
        m = self.median(name)
        return self.batch / m if m else None

    @property
    def refused(self) -> list[str]:
        return [n for n, r in self.runners.items() if not r.ok]

    def median(self, name: str) -> float | None:
        return self.timing.median(name) if self.timing.times.get(name) else None

    def speedup(self, base: str, of: str = FUSED) -> float | None:
        """How many times faster `of` is than `base` (median over median)."""
        a, b = self.median(base), self.median(of)
        return a / b if a and b else None

    def gflops(self, name: str, best: bool = False) -> float | None:
        """GFLOP/s of the median run (best: of the fastest run)."""
        samples = self.timing.times.get(name)
        if not samples or not self.flops:
            return None
        return self.flops / (min(samples) if best else statistics.median(samples)) / 1e9

    def sgemm_fraction(self, name: str = FUSED, best: bool = True) -> float | None:
        """GFLOP/s as a fraction of SGEMM's. best: fastest run against fastest SGEMM call, which
        a loaded machine disturbs least (OpenBLAS slows down far more than the runners when the
        cores are oversubscribed: medians 10x its best were seen); else median against median."""
        g, ref = self.gflops(name, best), self.sgemm.get("gflops_best" if best else "gflops")
        return g / ref if g and ref else None

    def to_dict(self) -> dict:
        runners = {}
        for name, info in self.runners.items():
            samples = self.timing.times.get(name) or []
            row = {"label": runner_label(name, self.mode), **vars(info)}
            row.pop("name")
            if samples:
                row.update(
                    **self.timing.stats(name),
                    throughput_per_s=self.throughput(name),
                    gflops=self.gflops(name),
                    gflops_best=self.gflops(name, best=True),
                    samples_ms=[s * 1e3 for s in samples],
                )
            runners[name] = row
        bases = [b for b in (ORT_NONE, ORT_ALL, NATIVE, ORT_FUSED) if b in self.runners]
        return {
            "workload": self.workload,
            "description": self.description,
            "mode": self.mode,
            "threads": self.threads,
            "batch": self.batch,
            "rounds": self.timing.rounds,
            "calls_per_turn": self.timing.repeat,
            "fused_nodes": self.fused,
            "gflop_per_run": self.flops / 1e9,
            "runners": runners,
            "refused": self.refused,
            "fusion_speedup_over": {b: self.speedup(b) for b in bases},
            "sgemm": self.sgemm,
            "fusion_fraction_of_sgemm": {
                "best": self.sgemm_fraction(best=True),
                "median": self.sgemm_fraction(best=False),
            },
            "profile": self.profile,
            "conv": self.conv,
            "block_traffic": self.traffic,
            "nodes": self.nodes,
            "slower_nodes": [n["name"] for n in self.slower_nodes],
            "compile": self.compile,
            "notes": self.notes,
        }
