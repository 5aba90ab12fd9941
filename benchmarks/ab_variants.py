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
     ["3 stages", [["v1_engine/kernels/triton_attention.py", "num_stages = 2", "num_stages = 3"]]],
     ["base", []]]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path


def load_variants(path: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The variants in `path`; ValueError naming the entry that is not [name, [[path, old, new]]]."""
    variants = []
    for index, entry in enumerate(json.loads(Path(path).read_text())):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"variant {index} must be [name, patches], got {entry!r}")
        patches = []
        for patch in entry[1]:
            if not (
                isinstance(patch, list)
                and len(patch) == 3
                and all(isinstance(s, str) for s in patch)
            ):
                raise ValueError(
                    f"variant {entry[0]!r}: a patch must be [path, old, new], got {patch!r}"
                )
            patches.append(tuple(patch))
        variants.append((entry[0], patches))
    return variants


def apply_patches(patches: list[tuple[str, str, str]]) -> dict[str, str]:
    """Applies the patches; returns each touched file's original text (for restore_files). A patch
    whose old text is missing restores what was applied and raises ValueError."""
    saved: dict[str, str] = {}
    try:
        for path, old, new in patches:
            text = Path(path).read_text()
            saved.setdefault(path, text)
            if old not in text:
                raise ValueError(f"{path}: the text to replace is not there: {old!r}")
            Path(path).write_text(text.replace(old, new, 1))
    except Exception:
        restore_files(saved)
        raise
    return saved


def restore_files(saved: dict[str, str]) -> None:
    for path, text in saved.items():
        Path(path).write_text(text)


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
    parser.add_argument("command", help="shell command run once per variant")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args()
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
