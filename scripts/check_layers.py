#!/usr/bin/env python3
"""Checks that #include lines run one way down kallpa's floors (docs/architecture.md).

Every `#include "..."` (and `#include <kallpa/...>`) in include/, src/, tools/, tests/support/ and
python/src/ is resolved to a file of the tree and both files are mapped to their floor. An include
fails when:

  * it reaches up: the included file sits on a higher floor than the including one;
  * it reaches sideways into another backend: src/backends/A includes src/backends/B's header;
  * the pipeline names a device: src/model, src/runtime or src/server includes a header of
    src/backends (the engine reaches devices only through src/ops).

Same-floor includes are fine. Includes that resolve to no file of the tree (system headers written
with quotes, headers generated at build time) are not judged. Exit status 0 when clean, 1 with one
line per violation (file:line, the include, both floors), 2 on a usage error.

Usage: check_layers.py [--root DIR] [--list]   (--list prints every file's floor and exits)
"""

from __future__ import annotations

import argparse
import os
import re
import sys

# Bottom to top. A floor may include its own and any lower floor's headers, never a higher one's.
FLOORS = ["contract", "core", "backends", "ops", "model", "runtime", "front", "tests"]
RANK = {name: n for n, name in enumerate(FLOORS)}

# (path prefix, floor), longest prefix first wins. Public headers live under include/kallpa; those
# in its subdirectories belong to the floor that implements them.
PREFIXES = [
    ("include/kallpa/ops/", "ops"),
    ("include/kallpa/tokenizer/", "ops"),
    ("include/kallpa/model/", "model"),
    ("include/kallpa/runtime/", "runtime"),
    ("include/kallpa/server/", "front"),
    ("include/kallpa/", "contract"),
    ("src/core/", "core"),
    # The conformance suite sits with the core: it is part of the attention library, the health
    # check runs it, and it judges backends only through the contract and the registry's oracle.
    ("src/conformance/", "core"),
    ("src/backends/", "backends"),
    ("src/ops/", "ops"),
    # The tokenizer is a leaf of the engine beside the ops: it needs only the contract, and the
    # model builds it from GGUF metadata (model/gguf_tokenizer.h).
    ("src/tokenizer/", "ops"),
    ("src/model/", "model"),
    ("src/runtime/", "runtime"),
    ("src/server/", "front"),
    # The measurement harness behind `kallpa bench`: a front end's helper over the attention library.
    ("src/harness/", "front"),
    ("tools/", "front"),
    # The Python package's bindings (python/src): a front end over the engine, like the CLI.
    ("python/", "front"),
    ("tests/support/", "tests"),
]
PREFIXES.sort(key=lambda p: len(p[0]), reverse=True)

SCANNED = ["include", "src", "tools", "tests/support", "python/src"]
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".c", ".cu", ".cuh", ".inl")
# Where a quoted include is looked up, after the including file's own directory (the include
# directories the CMake targets give).
SEARCH_DIRS = ["include", "src", "tests"]
PIPELINE = ("src/model/", "src/runtime/", "src/server/")

INCLUDE = re.compile(r'^\s*#\s*include\s*(?:"([^"]+)"|<(kallpa/[^>]+)>)')


def floor_of(rel: str) -> str | None:
    for prefix, floor in PREFIXES:
        if rel.startswith(prefix):
            return floor
    return None


def backend_of(rel: str) -> str | None:
    parts = rel.split("/")
    if len(parts) > 3 and parts[0] == "src" and parts[1] == "backends":
        return parts[2]
    return None


def resolve(root: str, including: str, name: str) -> str | None:
    """The included file's path relative to root, or None when it is not a file of the tree."""
    candidates = [os.path.join(os.path.dirname(including), name)] + [os.path.join(d, name) for d in SEARCH_DIRS]
    for c in candidates:
        path = os.path.normpath(os.path.join(root, c))
        if os.path.isfile(path):
            return os.path.relpath(path, root).replace(os.sep, "/")
    return None


def sources(root: str):
    for top in SCANNED:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for f in sorted(filenames):
                if f.endswith(SOURCE_SUFFIXES):
                    yield os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")


def check(root: str) -> list[str]:
    errors = []
    for rel in sources(root):
        src_floor = floor_of(rel)
        if src_floor is None:
            errors.append(f"{rel}: not on any floor (add its directory to scripts/check_layers.py)")
            continue
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                name = m.group(1) or m.group(2)
                target = resolve(root, rel, name)
                if target is None:
                    continue
                dst_floor = floor_of(target)
                if dst_floor is None:
                    errors.append(f"{rel}:{lineno}: includes \"{name}\" ({target}), which is on no floor")
                    continue
                where = f"{rel}:{lineno}: includes \"{name}\""
                if RANK[dst_floor] > RANK[src_floor]:
                    errors.append(f"{where}: floor '{src_floor}' reaches up to floor '{dst_floor}'")
                elif backend_of(rel) and backend_of(target) and backend_of(rel) != backend_of(target):
                    errors.append(f"{where}: backend '{backend_of(rel)}' reaches into backend '{backend_of(target)}'")
                elif rel.startswith(PIPELINE) and backend_of(target):
                    errors.append(f"{where}: floor '{src_floor}' names a device (backend '{backend_of(target)}'); "
                                  "the engine reaches devices through src/ops")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the source tree (default: this script's repository)")
    parser.add_argument("--list", action="store_true", help="print each scanned file's floor and exit")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.root, "src")):
        print(f"check_layers: {args.root} has no src/ directory", file=sys.stderr)
        return 2
    if args.list:
        for rel in sources(args.root):
            print(f"{floor_of(rel) or '-':9} {rel}")
        return 0
    errors = check(args.root)
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} include(s) break the floors (docs/architecture.md)", file=sys.stderr)
        return 1
    print(f"check_layers: every include runs down the floors ({' -> '.join(FLOORS[:-1])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
