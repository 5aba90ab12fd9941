"""Same-call A/B of source variants: patch the tree, run a benchmark command, restore, repeat.

Machine instances of the lent GPU differ by more than most single changes gain (batch-1 decode
4.07-4.12 ms for the same code), so a change is judged against its base in one device call. A
variants file is a JSON list of [name, patches]; a patch is [path, old text, new text] (the old
text must occur; its first occurrence is replaced). Every variant starts from the unpatched tree,
and the tree is restored after each run, also when the command fails or times out. The command's
table rows (lines starting "| ") are printed under the variant's name.

    python benchmarks/ab_variants.py variants.json \\
        'python benchmarks/latency.py --batch-sizes 1 --prefill-lens "" --repeats 3'

with variants.json, e.g.:

    [["base", []],
     ["3 stages", [["v1_engine/kernels/attention_launch.py", "num_stages = 2", "num_stages = 3"]]],
     ["base", []]]

A patch of two strings, [path, text], replaces the whole file (creating it if absent; restored
or removed after the run). To time the tree against an earlier commit's version of some files
on the device (which has no git), write the variants where git is:

    python benchmarks/ab_variants.py --make ab.json --rev 432d77a v1_engine/sample/sampler.py

gives base / 432d77a / base / 432d77a, the files as they were at that commit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

Patch = tuple[str, str, str] | tuple[str, str]
"""(path, old, new): the first occurrence of old replaced; (path, text): the whole file."""


def load_variants(path: str) -> list[tuple[str, list[Patch]]]:
    """The variants in `path`; ValueError naming the entry that is not [name, patches]."""
    variants = []
    for index, entry in enumerate(json.loads(Path(path).read_text())):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"variant {index} must be [name, patches], got {entry!r}")
        patches = []
        for patch in entry[1]:
            if not (
                isinstance(patch, list)
                and len(patch) in (2, 3)
                and all(isinstance(s, str) for s in patch)
            ):
                raise ValueError(
                    f"variant {entry[0]!r}: a patch must be [path, old, new] or [path, text], "
                    f"got {patch!r}"
                )
            patches.append(tuple(patch))
        variants.append((entry[0], patches))
    return variants


def apply_patches(patches: list[Patch]) -> dict[str, str | None]:
    """Applies the patches; returns each touched file's original text, None where the file did
    not exist (for restore_files). A patch whose old text is missing restores what was applied
    and raises ValueError."""
    saved: dict[str, str | None] = {}
    try:
        for path, *change in patches:
            file = Path(path)
            text = file.read_text() if file.exists() else None
            saved.setdefault(path, text)
            if len(change) == 1:
                file.write_text(change[0])
                continue
            old, new = change
            if text is None or old not in text:
                raise ValueError(f"{path}: the text to replace is not there: {old!r}")
            file.write_text(text.replace(old, new, 1))
    except Exception:
        restore_files(saved)
        raise
    return saved


def restore_files(saved: dict[str, str | None]) -> None:
    for path, text in saved.items():
        if text is None:
            Path(path).unlink(missing_ok=True)
        else:
            Path(path).write_text(text)


def make_variants(rev: str, paths: list[str]) -> list:
    """base / rev / base / rev, the rev variants holding `paths` as git has them at `rev` (a
    file absent there is left as it is)."""
    patches = []
    for path in paths:
        shown = subprocess.run(
            ["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=False
        )
        if shown.returncode == 0:
            patches.append([path, shown.stdout])
        elif "exists on disk, but not in" not in shown.stderr:
            raise SystemExit(f"git show {rev}:{path} failed: {shown.stderr.strip()}")
    return [["base", []], [rev, patches], ["base", []], [rev, patches]]


def table_rows(stdout: str) -> list[str]:
    """The command's markdown table rows, without headers and separators."""
    return [
        line
        for line in stdout.splitlines()
        if line.startswith("| ")
        and "---" not in line
        and not line.startswith("| batch")
        and not line.startswith("| tokens")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("variants", help="JSON file: [[name, [[path, old, new], ...]], ...]")
    parser.add_argument("command", nargs="?", help="shell command run once per variant")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument(
        "--make",
        action="store_true",
        help="write the variants file instead: base / --rev / base / --rev for the given paths",
    )
    parser.add_argument("--rev", help="with --make: the commit the other variant's files come from")
    parser.add_argument("paths", nargs="*", default=[], help="with --make: the files to take")
    args = parser.parse_intermixed_args()
    if args.make:
        if not args.rev:
            raise SystemExit("--make needs --rev")
        paths = ([args.command] if args.command else []) + args.paths
        Path(args.variants).write_text(json.dumps(make_variants(args.rev, paths), indent=1))
        return
    if args.command is None:
        raise SystemExit("a command to run is needed (or --make)")
    for name, patches in load_variants(args.variants):
        saved = apply_patches(patches)
        start = time.perf_counter()
        try:
            run = subprocess.run(
                args.command,
                check=False,
                shell=True,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            status, out, err = (
                f"rc={run.returncode}",
                run.stdout,
                run.stderr if run.returncode else "",
            )
        except subprocess.TimeoutExpired as exc:
            status, out, err = "timed out", exc.stdout or "", ""
            out = out if isinstance(out, str) else out.decode(errors="replace")
        finally:
            restore_files(saved)
        print(f"== {name}: {status}, {time.perf_counter() - start:.0f} s", flush=True)
        for row in table_rows(out):
            print("   " + row, flush=True)
        if err:
            print(err[-2000:], flush=True)


if __name__ == "__main__":
    main()
