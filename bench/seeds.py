"""Summarize a multirun of seeds: mean and spread of val_top1, median time to accuracy.

    python bench/seeds.py outputs/multirun/DATE/TIME
"""
import json
import statistics
import sys
from pathlib import Path

runs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*/summary.json"))]
acc = [r["val_top1"] for r in runs]
times = [r["train_and_eval_s"] for r in runs]
print(f"{len(runs)} runs: val_top1 mean {statistics.mean(acc):.4f} (min {min(acc):.4f}, max {max(acc):.4f}, "
      f"sd {statistics.pstdev(acc):.4f}); train+eval s median {statistics.median(times):.3f} "
      f"(min {min(times):.3f}, max {max(times):.3f}); setup s median "
      f"{statistics.median(r['setup_s'] for r in runs):.1f}; first step s median "
      f"{statistics.median(r['time_to_first_step_s'] for r in runs):.1f}")
for r in runs:
    print(json.dumps({k: r.get(k) for k in ("val_top1", "train_and_eval_s", "setup_s", "setup_parts_s", "steps")}))
