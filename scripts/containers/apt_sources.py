"""Print this machine's Debian apt sources for one release as one-line `deb` entries.

Reads /etc/apt/sources.list and /etc/apt/sources.list.d/*.list|*.sources (deb822), keeps the
enabled `deb` entries whose suite is the release or one of its -updates/-security suites, and
prints them for mmdebstrap. The base image is thus built from whatever mirror the host uses.

    python3 scripts/containers/apt_sources.py bookworm
"""

from __future__ import annotations

import sys
from pathlib import Path

APT = Path("/etc/apt")


def one_line(text: str):
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) >= 4 and words[0] == "deb":
            if words[1].startswith("["):  # options: deb [signed-by=...] uri suite comps
                while not words[1].endswith("]"):
                    words.pop(1)
                words.pop(1)
            yield words[1], words[2], words[3:]


def deb822(text: str):
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            if line[0].isspace() and key:
                fields[key] += " " + line.strip()
            else:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                yield uri, suite, fields.get("components", "main").split()


def entries(release: str):
    files = [APT / "sources.list", *sorted((APT / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        parse = deb822 if path.suffix == ".sources" else one_line if path.suffix in (".list", "") else None
        if parse is None:
            continue
        for uri, suite, components in parse(path.read_text()):
            if suite == release or suite.startswith(release + "-"):
                yield f"deb {uri} {suite} {' '.join(components)}"


def main(argv: list[str]) -> int:
    release = argv[0] if argv else "bookworm"
    found = list(dict.fromkeys(entries(release)))
    if not any(line.split()[2] == release for line in found):
        print(f"no apt source for {release} on this machine", file=sys.stderr)
        return 1
    print("\n".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
