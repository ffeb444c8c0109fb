"""ShadowKV's quality/memory front: decode perplexity at 8K of each rank rule against the
fast-tier bytes its compressed layers hold at a long context.

    python benchmarks/shadowkv_front.py --model gemma3-270m \
        --spectra analysis/gemma3-270m/key_spectra.json --full FULL.json --runs RUN.json [RUN.json ...] \
        [--ruler RULER.json ...] --out docs/results/eval/shadowkv_front_gemma3-270m.json

Inputs are files other commands measured:
- `--spectra`: `kvforge analyze key-spectra --tokens N` of the model (the pre-RoPE key energy
  curve of every layer over one N-token passage). rank=auto picks a layer's rank from exactly
  this curve at compression, so each rule's ranks at N tokens follow from it (the rule's own
  code, `ShadowKVConfig.layer_rank`), without a long prefill per rule;
  `--spectra` may also be an earlier front file, which keeps the global layers' curves;
- `--full` and `--runs`: `kvforge eval ppl` files over the same windows (the full cache and
  ShadowKV settings);
- `--ranks`: `benchmarks/shadowkv_ranks.py` over the spectra's passage; needed for
  `rank=attention` settings, whose ranks also depend on the prompt's queries;
- `--ruler` (optional): `kvforge eval ruler` files of the model itself, one seed each, one
  run per seed and setting; each setting's RULER is the mean over the seeds that scored it
  and the default full cache (seeds without a full-cache run are skipped).
Bytes come from the cache's own accounting (`compressed_global_bytes`, which a test holds
equal to the bytes of the tensors a compressed sequence keeps), for the global layers only:
sliding-window layers keep their window in both caches. The output JSON keeps only the
global layers' energy curves, so the front can be recomputed from it alone.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from kvforge.errors import require
from kvforge.tools.eval.shadowkv_front import front, spectra_of_front
from kvforge.tools.report.provenance import provenance


def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--spectra", required=True, help="kvforge analyze key-spectra JSON")
    parser.add_argument("--full", required=True, help="eval ppl JSON of the full cache")
    parser.add_argument("--runs", nargs="+", required=True, help="eval ppl JSON files of ShadowKV settings")
    parser.add_argument("--ruler", nargs="*", default=[], help="eval ruler JSON files (one seed each)")
    parser.add_argument("--ranks", default=None,
                        help="benchmarks/shadowkv_ranks.py JSON of the spectra's passage (rank=attention settings)")
    parser.add_argument("--bytes-at", type=int, default=None,
                        help="tokens at which to count bytes (default: the spectra's passage length)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.command_line = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    spectra = _load(args.spectra)
    if spectra.get("eval") == "shadowkv-front":
        require(spectra["model"] == args.model, "--spectra", args.spectra, f"is a front of {spectra['model']}, "
                f"not of --model {args.model}")
        spectra = spectra_of_front(spectra)
    doc = front(args.model, spectra, _load(args.full), [_load(p) for p in args.runs], args.bytes_at,
                [_load(p) for p in args.ruler], _load(args.ranks) if args.ranks else None)
    doc["provenance"] = provenance(args)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for s in doc["systems"]:
        print(f"{s['name']:<42} ppl {s['ppl']:.3f} ({s['delta_pct']:+.2f}%)  ranks {s['ranks']}  "
              f"fast {s['fast_bytes'] / 2**20:.1f} MiB = {s['times_smaller']:.2f}x smaller than full"
              + (f"  RULER {s['ruler']['average']:.1f} vs {s['ruler']['full_average']:.1f}" if s["ruler"] else ""))


if __name__ == "__main__":
    main()
