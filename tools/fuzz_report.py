"""Fuzz the shardstream readers outside pytest and print a table of outcomes.

Runs the mutation strategies of tests/test_fuzz.py (the same `draw_mutation`, the same
read paths, watchdog and checks) with `random.Random` instead of hypothesis, over the
zstd and the uncompressed dataset in turn, and counts what happened: samples returned,
each `ShardstreamError` subclass, other exceptions (by type and place; must be 0) and
hangs (must be 0). Known open bugs (tests/test_fuzz.py KNOWN_BUGS) are counted in those
rows too, marked with their id. Forged tar headers include negative size fields, as in
the tests (`--no-hostile-sizes` leaves them out).

    python tools/fuzz_report.py              # 2000 mutated inputs
    python tools/fuzz_report.py 500 --seed 3 --time-budget 120 --decode 2000

Exit status 1 if any other exception, hang or property violation was seen.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = (("shard", 35), ("raw", 25), ("index", 20), ("manifest", 20))
PATHS = ("dataset", "shard", "noindex")


def load_harness():
    # The harness imports its sibling test modules (test_format's pure-Python cut) by name.
    sys.path.insert(0, str(ROOT / "tests"))
    spec = importlib.util.spec_from_file_location("shardstream_fuzz_harness", ROOT / "tests" / "test_fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="?", type=int, default=2000, help="mutated inputs to try (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="watchdog per read path, seconds (default 2; a normal read takes milliseconds)")
    parser.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--no-hostile-sizes", action="store_true", help="no negative size fields in forged headers")
    parser.add_argument("--decode", type=int, default=0, help="also fuzz the field decoders with this many inputs")
    parser.add_argument("--examples-shown", type=int, default=3, help="mutations shown per failure signature")
    args = parser.parse_args(argv)

    H = load_harness()  # imports torch too (the image decoder needs it; never under the watchdog)
    rng = random.Random(args.seed)
    chooser = H.RandomChooser(rng)
    families = [f for f, _ in FAMILIES]
    weights = [w for _, w in FAMILIES]

    started = time.perf_counter()
    tried = collections.Counter()  # (compression, family)
    outcomes = collections.Counter()  # (compression, path, label)
    totals = collections.Counter()  # (compression, label) over all paths
    kinds = collections.Counter()  # kind over all reads
    failures: dict[str, list[str]] = collections.defaultdict(list)  # signature -> mutations
    violations: dict[str, list[str]] = collections.defaultdict(list)
    short: dict[str, list[str]] = collections.defaultdict(list)  # compression -> mutations
    silent: dict[str, list[str]] = collections.defaultdict(list)  # known silent bug -> examples
    short_kinds = collections.Counter()  # (compression, mutation kind)
    reads = 0
    with tempfile.TemporaryDirectory(prefix="shardstream-fuzz-") as tmp:
        corpora = {c: H.make_corpus(Path(tmp, c), c) for c in ("zstd", "none")}
        built = time.perf_counter() - started
        done = 0
        for i in range(args.examples):
            if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                break
            compression = ("zstd", "none")[i % 2]
            corpus = corpora[compression]
            family = rng.choices(families, weights)[0]
            mutation = H.draw_mutation(chooser, corpus, family, hostile_sizes=not args.no_hostile_sizes)
            changed, result = H.run_mutation(corpus, mutation, family, args.timeout)
            tried[compression, family] += 1
            done += 1
            for path, outcome in result.items():
                reads += 1
                kinds[outcome.kind] += 1
                label = outcome.label if outcome.kind != "samples" else "samples returned"
                if outcome.kind in ("other", "known", "hang"):
                    hang = "Hang@" in outcome.label
                    # Known bugs by id (a hang is caught wherever the loop happens to be); new ones by signature.
                    what = outcome.label.split(":")[0] if outcome.kind == "known" else outcome.label
                    label = f"{'HANG' if hang else 'EXC'} {what}{' (known)' if outcome.kind == 'known' else ' (NEW)'}"
                    failures[outcome.label].append(f"#{i} {compression} {path}: {mutation!r}")
                outcomes[compression, path, label] += 1
                totals[compression, label] += 1
            if family in ("shard", "raw") and H.short_reads(corpus, mutation, result):
                short[compression].append(f"#{i}: {mutation!r}")
                short_kinds[compression, mutation.kind if family == "shard" else f"raw {mutation.note}"] += 1
            known_notes: list[str] = []
            problems = H.check_outcomes(corpus, mutation, family, changed, result, known_notes)
            for note in known_notes:
                silent[note.split(":")[0]].append(f"#{i} {compression}: {note.split(': ', 1)[1]}: {mutation!r}")
            for problem in problems:
                if problem.split(":")[1].strip().startswith(("other", "hang")):
                    continue  # counted above
                key = problem.splitlines()[0].split(": ", 1)[1]
                key = "changed sample returned" if "changed bytes" in key else key
                violations[f"{compression} {family}: {key}"].append(f"#{i}: {mutation!r}")
        elapsed = time.perf_counter() - started

        decode_rows = fuzz_decoders(H, rng, args.decode, args.timeout) if args.decode else None

    print("# shardstream fuzz report")
    print()
    print(f"command: python tools/fuzz_report.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"date: {datetime.date.today().isoformat()}; machine: {os.cpu_count()} cores, {platform.machine()}, "
          f"Python {platform.python_version()}")
    print(f"mutated inputs tried: {done} in {elapsed:.1f} s (dataset build {built:.1f} s); reads: {reads}; "
          f"watchdog {args.timeout:g} s per read path; hostile sizes: {not args.no_hostile_sizes}")
    print(f"replay an example `#i`: rerun with the same --seed ({args.seed}) and at least i + 1 examples")
    print()
    print("## mutated inputs by target")
    print()
    print("| dataset | " + " | ".join(families) + " | total |")
    print("| --- |" + " ---: |" * (len(families) + 1))
    for c in ("zstd", "none"):
        row = [tried[c, f] for f in families]
        print(f"| {c} | " + " | ".join(map(str, row)) + f" | {sum(row)} |")
    print()
    print("## outcomes per read (a mutated input is read by up to 3 paths)")
    print()
    labels = sorted({label for (_, label) in totals}, key=_order)
    print("| outcome | " + " | ".join(f"{c} {p}" for c in ("zstd", "none") for p in PATHS) + " | total |")
    print("| --- |" + " ---: |" * (2 * len(PATHS) + 1))
    for label in labels:
        cells = [outcomes[c, p, label] for c in ("zstd", "none") for p in PATHS]
        print(f"| {label} | " + " | ".join(map(str, cells)) + f" | {sum(cells)} |")
    other = sum(n for (c, label), n in totals.items() if label.startswith("EXC "))
    hangs = sum(n for (c, label), n in totals.items() if label.startswith("HANG "))
    print()
    print(f"**other exceptions: {other}** (must be 0); **hangs: {hangs}** (must be 0); "
          f"ShardstreamError: {kinds['error']}; samples returned: {kinds['samples']}")
    known = {bug.id: bug for bug in H.KNOWN_BUGS}
    if failures:
        print()
        print("## other exceptions and hangs, by signature")
        print()
        for sig, examples in sorted(failures.items(), key=lambda kv: -len(kv[1])):
            bug = sig.split(":")[0] if sig.split(":")[0] in known else None
            tag = f" (known bug `{bug}`, reproducer `{known[bug].reproducer}`)" if bug else " (NEW)"
            print(f"* {len(examples)} x `{sig}`{tag}")
            for ex in examples[: args.examples_shown]:
                print(f"  * `{ex}`")
    print()
    print("## property violations")
    print()
    if not violations:
        print("none")
    for key, examples in sorted(violations.items()):
        print(f"* {len(examples)} x {key}")
        for ex in examples[: args.examples_shown]:
            print(f"  * `{ex}`")
    print()
    print("## known silent deviations (samples returned with other contents, no error)")
    print()
    if not silent:
        print("none seen")
    for bug, examples in sorted(silent.items()):
        print(f"* {len(examples)} x `{bug}`: {H.SILENT_BUGS[bug]}")
        for ex in examples[: args.examples_shown]:
            print(f"  * `{ex}`")
    print()
    print("## observation: short reads without an index")
    print()
    print("Mutated shards read by `open_shard` without their index that returned samples, without error, but not")
    print("every sample whole (a tar ending early at a member boundary, or at a zero block, is accepted, as GNU")
    print("tar does). For zstd, a cut exactly at a frame boundary ends the stream cleanly; a cut or damage inside a")
    print("frame is an error since `truncated-zstd-stream` was fixed; `raw` ones are forged tar headers inside valid")
    print("frames, read as tar reads them):")
    print()
    for c in ("zstd", "none"):
        n = sum(tried[c, f] for f in ("shard", "raw"))
        kinds_seen = ", ".join(f"{k}: {v}" for (cc, k), v in sorted(short_kinds.items()) if cc == c)
        print(f"* {c}: {len(short[c])} of {n} shard mutations ({kinds_seen or 'none'})")
        for ex in short[c][: args.examples_shown]:
            print(f"  * `{ex}`")
    if decode_rows is not None:
        print()
        print("## field decoders (Decoder(images='rgb8')), mutated valid fields")
        print()
        print("| field | inputs | decoded | DecodeError | other exceptions | hangs |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for field, row in sorted(decode_rows.items()):
            others = ", ".join(f"{n} x {sig}" for sig, n in row["sigs"].most_common())
            print(f"| {field} | {row['n']} | {row['samples']} | {row['error']} | {row['other']}"
                  f"{' (' + others + ')' if others else ''} | {row['hang']} |")
    bad = other + hangs + sum(len(v) for v in violations.values())
    if decode_rows is not None:
        bad += sum(r["other"] + r["hang"] for r in decode_rows.values())
    return 1 if bad else 0


def _order(label: str) -> tuple[int, str]:
    return (0 if label == "samples returned" else 2 if label.startswith(("EXC", "HANG")) else 1, label)


def fuzz_decoders(H, rng, n, timeout):
    rows: dict[str, dict] = {}
    fields = sorted(H.FIELD_SEEDS) + ["jpg"]
    for i in range(n):
        field = fields[i % len(fields)]
        seed = H.JPEG if field == "jpg" else H.FIELD_SEEDS[field]
        blob = bytearray(seed)
        how = rng.choice(["flip", "truncate", "insert", "garbage"])
        if how == "flip":
            for _ in range(rng.randint(1, 4)):
                blob[rng.randrange(len(blob))] ^= rng.randint(1, 255)
        elif how == "truncate":
            del blob[rng.randrange(len(blob)) :]
        elif how == "insert":
            at = rng.randint(0, len(blob))
            blob[at:at] = rng.randbytes(rng.randint(1, 64))
        else:
            blob = bytearray(rng.randbytes(rng.randint(0, 256)))
        outcome = H._decode(field, bytes(blob), timeout=timeout)
        row = rows.setdefault(field, {"n": 0, "samples": 0, "error": 0, "other": 0, "hang": 0,
                                      "sigs": collections.Counter()})
        row["n"] += 1
        if outcome.kind == "samples":
            row["samples"] += 1
        elif outcome.kind == "error":
            row["error"] += 1
        elif outcome.kind == "hang":
            row["hang"] += 1
            row["sigs"][outcome.label] += 1
        else:
            row["other"] += 1
            row["sigs"][outcome.label] += 1
    return rows


if __name__ == "__main__":
    sys.exit(main())
