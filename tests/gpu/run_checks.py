"""Run every `@gpu` check in tests/gpu/test_*.py without pytest; write a JSON report.

    python -m tests.gpu.run_checks --out benchmarks/results/gpu_checks.json

Used by scripts/gpu_check.sh because the GPU machine may have only torch and triton.
Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _outcome(exc: BaseException) -> str:
    from tests.gpu.gpu_support import SkipCheck

    if isinstance(exc, SkipCheck) or type(exc).__name__ == "Skipped":  # pytest.skip
        return "skipped"
    return "failed"


def run(pattern: str = "test_*.py", select: str | None = None) -> list[dict]:
    results = []
    for file in sorted(HERE.glob(pattern)):
        spec = importlib.util.spec_from_file_location(f"gpu_checks_{file.stem}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            results.append({"check": file.name, "outcome": "failed", "error": repr(exc)})
            continue
        for name in sorted(dir(module)):
            fn = getattr(module, name)
            if not (name.startswith("test_") and callable(fn) and getattr(fn, "gpu", False)):
                continue
            if select and select not in name:
                continue
            start = time.perf_counter()
            entry = {"check": f"{file.name}::{name}", "outcome": "passed"}
            try:
                fn()
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                entry["outcome"] = _outcome(exc)
                entry["error"] = "".join(traceback.format_exception_only(exc)).strip()
                if entry["outcome"] == "failed":
                    entry["traceback"] = traceback.format_exc()
            entry["seconds"] = round(time.perf_counter() - start, 3)
            print(f"{entry['outcome']:>8}  {entry['seconds']:7.2f}s  {entry['check']}", flush=True)
            if entry["outcome"] != "passed":
                print(f"          {entry['error']}", flush=True)
            results.append(entry)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON report path")
    ap.add_argument("-k", dest="select", default=None, help="run checks whose name contains this")
    args = ap.parse_args(argv)
    import torch

    results = run(select=args.select)
    counts = {o: sum(r["outcome"] == o for r in results) for o in ("passed", "failed", "skipped")}
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "counts": counts,
        "results": results,
    }
    print(json.dumps(counts))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if counts["failed"] or not results else 0


if __name__ == "__main__":
    raise SystemExit(main())
