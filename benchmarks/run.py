"""Runs every ``benchmarks/bench_*.py`` module's ``run()`` and prints one JSON line per record.

Usage::

    python -m benchmarks.run                 # all benchmarks
    python -m benchmarks.run controller      # only modules whose name contains "controller"
    python -m benchmarks.run --list

Each record carries the benchmark module, the machine (cores, CPU model, its vector extensions and
the instruction sets torch uses — capped by `ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA` and
`MKL_ENABLE_INSTRUCTIONS` where set —, torch version)
and the figures with their units, so a line pasted into docs/benchmarks.md stands alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import sys
import time
import traceback

import benchmarks

# the /proc/cpuinfo flags a record names: the x86 vector extensions torch's kernels choose between
VECTOR_EXTENSIONS = frozenset(
    {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
)


def _machine() -> dict:
    import torch

    from rlflow.engine.parallelize import cpu_bf16_speedup, cpu_computes_bf16, cpu_flags, cpu_isa_caps, cpu_model

    native = cpu_computes_bf16()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "vector_extensions": sorted(cpu_flags() & VECTOR_EXTENSIONS),
        # what torch's kernels use here: lower than the CPU's extensions where the environment caps them
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": cpu_isa_caps(),
        "native_bf16": native,
        # bf16 matmul speed / fp32's on one thread, as dtype: auto measured it (null without native bf16)
        "bf16_matmul_speedup": round(cpu_bf16_speedup(), 2) if native else None,
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _modules(patterns: list[str]) -> list[str]:
    names = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    if patterns:
        names = [n for n in names if any(p in n for p in patterns)]
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patterns", nargs="*", help="substrings of benchmark module names to run")
    parser.add_argument("--list", action="store_true", help="list the benchmark modules and exit")
    args = parser.parse_args(argv)
    names = _modules(args.patterns)
    if args.list or not names:
        print("\n".join(names) if names else f"no benchmark matches {args.patterns}", file=sys.stderr)
        return 0 if names else 2
    machine = _machine()
    failed = []
    for name in names:
        start = time.perf_counter()
        try:
            records = importlib.import_module(f"benchmarks.{name}").run()
        except Exception:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            failed.append(name)
            continue
        for record in records:
            print(json.dumps({"benchmark": name, **record, "machine": machine}), flush=True)
        print(f"# {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if failed:
        print(f"# failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
