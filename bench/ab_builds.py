"""Two builds of jax_flash's extension module, timed side by side on one machine.

A kernel change is judged against its base build: the same cells of bench_attention.py or
bench_masks.py run in alternating processes, each loading one build's extension module, with
the peers the bench times (cuDNN, ...) in every process. Rounds alternate the order (a then b,
then b then a), so that a drift of the machine's clocks falls on both builds.

  python bench/ab_builds.py --a base.so --b change.so --rounds 2 bench_attention.py \\
      --mode fwd --head-dims 64 --seqlens 512,1024 --causal yes --impls jax_flash,cudnn
  python bench/ab_builds.py --a base.so --b change.so bench_masks.py \\
      --families learned_bias,capped_learned_bias --modes fwd

(ab_builds.py's own options come before the bench's name; everything after it goes to the
bench.)

A build is an extension module file (`jax_flash/_jax_flash_ext*.so`) built from the same
Python sources as the installed package, e.g. the one `.ci/gpu OUT build` copies to OUT. Before
each process the installed module is replaced by a copy of the build's (an atomic rename, so
processes that have the old one loaded keep it), and the module installed at the start is put
back at the end, also after an error.

Prints, per row (a cell or a bench_masks way), implementation and round, each build's
throughput and b/a, and each over the peer (--peer, default cuDNN) timed in its own process. Writes
ab_builds.json (every process's throughputs and the ratios) and ab_builds.png (b/a per row)
under --out (default bench/out).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_attention  # noqa: E402  (result files, throughput units)

BENCHES = ("bench_attention.py", "bench_masks.py")
BUILDS = ("a", "b")


def installed_module() -> Path:
  """The installed extension module's file (imported by path, not from a source tree)."""
  out = subprocess.run(
      [sys.executable, "-P", "-c",
       "import jax_flash._jax_flash_ext as m; print(m.__file__)"],
      capture_output=True, text=True, check=True)
  return Path(out.stdout.strip())


def _place(source: Path, target: Path) -> None:
  """Puts a copy of `source` at `target` by an atomic rename within target's directory."""
  fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".ab_", suffix=target.suffix)
  os.close(fd)
  try:
    shutil.copyfile(source, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


@contextlib.contextmanager
def restored(target: Path):
  """Keeps a copy of the installed module and puts it back on leaving."""
  with tempfile.TemporaryDirectory() as keep:
    original = Path(keep) / target.name
    shutil.copyfile(target, original)
    try:
      yield
    finally:
      _place(original, target)


def throughputs(data: dict) -> dict[str, dict[str, float]]:
  """{row label: {implementation: FLOP/s}} of a bench_attention.py or bench_masks.py result,
  the rows that ran without error."""
  rows: dict[str, dict[str, float]] = {}
  if "cells" in data:  # bench_attention.py
    mode = data["metadata"]["mode"]
    for cell in data["cells"]:
      s = cell["shape"]
      label = (f"{mode} H{s['head_dim']} T{s['q_len']} "
               f"{'causal' if s['causal'] else 'full'} B{s['batch']} N{s['heads']}")
      for impl, r in cell["results"].items():
        if r.get("status") == bench_attention.STATUS_OK:
          rows.setdefault(label, {})[impl] = r["flops_per_s"]
  else:  # bench_masks.py
    for row in data["results"]:
      if not row.get("error") and "flops_per_s" in row:
        rows.setdefault(f"{row['mode']} {row['family']}/{row['way']}", {})[row["impl"]] = (
            row["flops_per_s"])
  return rows


def run_bench(bench: str, bench_args: list[str], out: Path) -> dict:
  """One process of `bench` writing under `out`; its JSON result."""
  out.mkdir(parents=True, exist_ok=True)
  # By path: the bench's own directory goes first on sys.path, the source tree's package not.
  command = [sys.executable, str(HERE / bench), *bench_args, "--out", str(out)]
  subprocess.run(command, check=True)
  found = list(out.glob("*.json"))  # (a partial write is *.json.tmp)
  if len(found) != 1:
    raise RuntimeError(f"{bench} wrote {len(found)} JSON files under {out}, expected one")
  return json.loads(found[0].read_text())


def compare(runs: list[dict], peer: str) -> list[dict]:
  """Per row and jax_flash implementation: each build's throughputs over the rounds, b/a of
  each round, and each build over `peer` as timed in its own process."""
  rounds = sorted({r["round"] for r in runs})
  by = {(r["round"], r["build"]): r["throughputs"] for r in runs}
  labels = list(dict.fromkeys(label for r in runs for label in r["throughputs"]))
  rows = []
  for label in labels:
    impls = dict.fromkeys(i for r in runs for i in r["throughputs"].get(label, {})
                          if i.startswith("jax_flash"))
    for impl in impls:
      row = {"label": label, "impl": impl, "peer": peer}
      for build in BUILDS:
        row[build] = [by[k, build].get(label, {}).get(impl) for k in rounds]
        row[f"{build}_over_peer"] = [
            (by[k, build][label][impl] / by[k, build][label][peer])
            if by[k, build].get(label, {}).get(impl) and by[k, build][label].get(peer) else None
            for k in rounds]
      row["b_over_a"] = [b / a if a and b else None for a, b in zip(row["a"], row["b"])]
      rows.append(row)
  return rows


def _span(values, fmt: str) -> str:
  known = [v for v in values if v is not None]
  if not known:
    return "-"
  lo, hi = min(known), max(known)
  return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"


def table(rows: list[dict], platform: str, peer: str) -> list[str]:
  unit, scale = bench_attention.throughput_unit(platform)
  head = (f"{'row':<44} {'impl':<18} | {'a ' + unit:>16} {'b ' + unit:>16} | {'b/a':>11} | "
          f"{'a/' + peer:>11} {'b/' + peer:>11}")
  lines = [head, "-" * len(head)]
  for r in rows:
    a = " ".join(f"{v / scale:.1f}" if v else "-" for v in r["a"])
    b = " ".join(f"{v / scale:.1f}" if v else "-" for v in r["b"])
    lines.append(f"{r['label']:<44} {r['impl']:<18} | {a:>16} {b:>16} | "
                 f"{_span(r['b_over_a'], '.3f'):>11} | {_span(r['a_over_peer'], '.2f'):>11} "
                 f"{_span(r['b_over_peer'], '.2f'):>11}")
  return lines


def plot(data: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in data["rows"] if any(v is not None for v in r["b_over_a"])]
  if not rows:
    return
  names = [f"{r['label']} {r['impl']}" for r in rows]
  means = [statistics.mean(v for v in r["b_over_a"] if v is not None) for r in rows]
  lows = [m - min(v for v in r["b_over_a"] if v is not None) for m, r in zip(means, rows)]
  highs = [max(v for v in r["b_over_a"] if v is not None) - m for m, r in zip(means, rows)]
  fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
  ax.barh(range(len(rows)), [m - 1 for m in means], left=1, xerr=[lows, highs],
          color=["tab:green" if m >= 1 else "tab:red" for m in means])
  ax.axvline(1, color="black", linewidth=0.8)
  ax.set_yticks(range(len(rows)), names, fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("throughput of b / a (bars: mean over rounds; whiskers: range)")
  meta = data["metadata"]
  ax.set_title(f"{meta['device_kind']}: {Path(meta['a']).name} (a) vs {Path(meta['b']).name} (b)",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--a", required=True, type=Path, help="the base build's extension module")
  p.add_argument("--b", required=True, type=Path, help="the changed build's extension module")
  p.add_argument("--rounds", type=int, default=2, help="processes per build (default 2)")
  p.add_argument("--peer", default="cudnn",
                 help="the implementation each build is compared with in its own process "
                      "(default cudnn)")
  p.add_argument("--out", type=Path, default=bench_attention.DEFAULT_OUT)
  p.add_argument("bench", choices=BENCHES, help="the benchmark each process runs")
  p.add_argument("bench_args", nargs=argparse.REMAINDER,
                 help="its arguments (not --out: each process writes under --out/ab_runs)")
  args = p.parse_args(argv)
  if args.rounds < 1:
    p.error("--rounds: at least 1")
  for name in BUILDS:
    if not getattr(args, name).is_file():
      p.error(f"--{name}: no such file {getattr(args, name)}")
  if "--out" in args.bench_args:
    p.error("the bench's --out is set per process; give --out before the bench's name")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  target = installed_module()
  builds = {name: getattr(args, name).resolve() for name in BUILDS}
  runs = []
  with restored(target), tempfile.TemporaryDirectory() as work:
    for k in range(args.rounds):
      for build in BUILDS if k % 2 == 0 else BUILDS[::-1]:
        print(f"=== round {k + 1}, build {build} ({builds[build].name})", flush=True)
        _place(builds[build], target)
        data = run_bench(args.bench, args.bench_args, Path(work) / f"round{k + 1}_{build}")
        runs.append({"round": k + 1, "build": build, "metadata": data["metadata"],
                     "throughputs": throughputs(data)})
  platform = runs[0]["metadata"]["platform"]
  rows = compare(runs, args.peer)
  data = {
      "metadata": {"platform": platform, "device_kind": runs[0]["metadata"]["device_kind"],
                   "date_utc": runs[0]["metadata"].get("date_utc"),
                   "a": str(builds["a"]), "a_sha256": _sha256(builds["a"]),
                   "b": str(builds["b"]), "b_sha256": _sha256(builds["b"]),
                   "rounds": args.rounds, "peer": args.peer,
                   "bench": [args.bench, *args.bench_args]},
      "runs": runs,
      "rows": rows,
  }
  bench_attention.save_results(data, str(args.out), "ab_builds",
                               table(rows, platform, args.peer), plot)
  return data


if __name__ == "__main__":
  main()
