"""Write the JSON Schema of every published message into schemas/json/.

python -m lorafleet_schemas.generate          # rewrite the files
python -m lorafleet_schemas.generate --check  # exit 1 when they are stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from lorafleet_schemas.messages import PUBLISHED

#: schemas/json/ in a checkout (and inside the wheel, next to this module).
JSON_DIR = Path(__file__).resolve().parent.parent / "json"


def render() -> dict[str, str]:
    """File name -> file text for every published message."""
    out: dict[str, str] = {}
    for name, typ in PUBLISHED.items():
        schema = msgspec.json.schema(typ)
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": name,
            **schema,
        }
        out[f"{name}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def stale(directory: Path = JSON_DIR) -> list[str]:
    """Files missing, different or left over in `directory`."""
    want = render()
    have = {p.name for p in directory.glob("*.schema.json")} if directory.is_dir() else set()
    bad = [
        n
        for n, text in want.items()
        if not (directory / n).is_file() or (directory / n).read_text() != text
    ]
    bad += sorted(have - set(want))
    return bad


def write(directory: Path = JSON_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    want = render()
    for p in directory.glob("*.schema.json"):
        if p.name not in want:
            p.unlink()
    for n, text in want.items():
        (directory / n).write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        bad = stale()
        if bad:
            print("stale schemas (run python -m lorafleet_schemas.generate):", *bad, sep="\n  ")
            return 1
        return 0
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
