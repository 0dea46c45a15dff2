"""`make fuzz`: every harness under fuzz/ for a while each, one process per harness.

    python -m fuzz.run [--seconds N] [harness ...]

Seeds come from fuzz/corpus/<harness>/ (committed); what libFuzzer learns goes to
run/fuzz/<harness>/corpus (not committed) and a crashing input to run/fuzz/<harness>/crash-*.
Replay one: python -m fuzz.<harness> run/fuzz/<harness>/crash-<sha1>. Exit status 1 if any crashed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = ("tenants", "routing", "manifest", "kserve_codec", "image_decode", "attach_hello", "quota_reply")


def run_one(name: str, seconds: int) -> bool:
    work = ROOT / "run" / "fuzz" / name
    (work / "corpus").mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", f"fuzz.{name}", str(work / "corpus"), str(ROOT / "fuzz" / "corpus" / name),
        f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048", "-max_len=65536",
        f"-artifact_prefix={work}/", "-print_final_stats=1",
    ]
    began = time.monotonic()
    with open(work / "fuzz.log", "w") as log:
        returncode = subprocess.call(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONHASHSEED": "0"})
    stats = _final_stats(work / "fuzz.log")
    verdict = "ok" if returncode == 0 else f"CRASH (exit {returncode}; see {work}/fuzz.log)"
    print(f"{name:14s} {time.monotonic() - began:6.0f} s  {stats}  {verdict}", flush=True)
    return returncode == 0


def _final_stats(log: Path) -> str:
    wanted = ("stat::number_of_executed_units", "stat::new_units_added")
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        for name in wanted:
            if line.startswith(name):
                found[name.split("::")[1]] = line.rsplit(":", 1)[1].strip()
    return ", ".join(f"{k} {v}" for k, v in found.items()) or "(no stats)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=int(os.environ.get("FUZZ_SECONDS", "180")),
                        help="per harness (default: FUZZ_SECONDS or 180)")
    parser.add_argument("harnesses", nargs="*", help=f"some of {', '.join(HARNESSES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.harnesses) - set(HARNESSES))
    if unknown:
        parser.error(f"no harness {unknown}; there are {', '.join(HARNESSES)}")
    results = [run_one(name, args.seconds) for name in args.harnesses or HARNESSES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
