"""The embedded corpus: English prose and Python code taken from the running Python's standard library.

Nothing is downloaded. Two domains:

* "prose": module, class and function docstrings (``ast.get_docstring``, cleaned with
  ``inspect.cleandoc``), the docstrings of one module packed into documents of ~1.5k characters,
  plus the language-reference topics that pydoc ships (``pydoc_data/topics.py``);
* "code": the module source with its docstrings cut out (they are the prose domain, so the two
  domains share no text), split at blank lines and packed the same way. Comments are kept.

Files are walked in sorted order, then shuffled by ``seed``; the split is by *source unit*
(a module file, or one pydoc topic; see ``split_files``): valid and test each get ~``frac`` of
both domains' characters, the rest is train. So held-out documents come from modules (topics)
the teacher never saw. The corpus depends on the Python version: its content hash
(``corpus_hash``) is part of every cache key built on it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
import tokenize
from collections.abc import Iterator
from pathlib import Path

SPLITS = ("train", "valid", "test")
DOMAINS = ("prose", "code")
CORPUS_VERSION = 1  # bump when the document building changes
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "turtledemo",
    "ensurepip",
    "__pycache__",
    "lib-dynload",
    "encodings",
    "pydoc_data",
    "venv",
    "__phello__",
    "config",
}
MAX_FILE_BYTES = 400_000  # larger files are mostly generated tables
TOPICS = "pydoc_data/topics.py"  # the reference manual's topics as a dict of strings: prose only


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files in sorted order, without tests, IDLE, demos and generated tables."""
    root = Path(root or stdlib_dir())
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel[:-1]):
            continue
        if rel[-1].startswith("test_") or p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(p)
    if (root / TOPICS).is_file():
        out.append(root / TOPICS)
    return sorted(out)


def _docstring_nodes(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.Expr]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield node, first


def file_documents(source: str, target: int = 1500, limit: int = 2000) -> dict[str, list[str]]:
    """Split one module's source into prose (docstrings) and code (source without docstrings) documents."""
    tree = ast.parse(source)
    found = sorted(_docstring_nodes(tree), key=lambda ne: (ne[1].lineno, ne[1].col_offset))
    docs = [ast.get_docstring(node, clean=True) or "" for node, _ in found]
    lines = source.splitlines()
    drop: set[int] = set()
    for _, expr in found:
        first, last = expr.lineno - 1, expr.end_lineno - 1
        # cut only docstrings that own their lines (`def f(): "doc"` stays in the code)
        if not lines[first][: expr.col_offset].strip() and not lines[last][expr.end_col_offset :].strip():
            drop.update(range(first, last + 1))
    code = "\n".join(line.rstrip() for i, line in enumerate(lines) if i not in drop)
    blocks = [b.strip("\n") for b in code.split("\n\n")]
    return {
        "prose": pack([d.strip() for d in docs], target, limit),
        "code": pack([b for b in blocks if b.strip()], target, limit),
    }


def topic_units(source: str, target: int = 1500, limit: int = 2000) -> list[tuple[str, dict[str, list[str]]]]:
    """pydoc's reference topics (a literal dict name -> text) as prose, one unit per topic in sorted order."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return [
                (
                    f"{TOPICS}#{name}",
                    {"prose": pack([p.strip("\n") for p in text.split("\n\n")], target, limit), "code": []},
                )
                for name, text in sorted(topics.items())
            ]
    return []


def pack(pieces: list[str], target: int = 1500, limit: int = 2000) -> list[str]:
    """Join consecutive pieces (by a blank line) into documents of about ``target`` and at most ``limit`` chars.

    A piece longer than ``limit`` is cut at line breaks (or hard, for a single overlong line).
    """
    parts: list[str] = []
    for piece in pieces:
        if not piece.strip():
            continue
        if len(piece) <= limit:
            parts.append(piece)
            continue
        cur = ""
        for line in piece.split("\n"):
            while len(line) > limit:
                if cur:
                    parts.append(cur)
                    cur = ""
                parts.append(line[:limit])
                line = line[limit:]
            if cur and len(cur) + 1 + len(line) > limit:
                parts.append(cur)
                cur = line
            else:
                cur = f"{cur}\n{line}" if cur else line
        if cur.strip():
            parts.append(cur)
    docs: list[str] = []
    cur = ""
    for part in parts:
        if cur and (len(cur) >= target or len(cur) + 2 + len(part) > limit):
            docs.append(cur)
            cur = ""
        cur = f"{cur}\n\n{part}" if cur else part
    if cur:
        docs.append(cur)
    return docs


def collect(
    max_chars: int | None, seed: int, root: Path | None = None
) -> list[tuple[str, dict[str, list[str]]]]:
    """Documents per unit (a file, or one pydoc topic), units in seeded order, until each domain holds
    ``max_chars / 2`` characters.

    With a budget, one unit gives at most ``max(2000, max_chars // 40)`` characters per domain, so a
    small corpus still spans many modules.
    """
    root = Path(root or stdlib_dir())
    units: list[tuple[str, dict[str, list[str]]] | Path] = []
    for path in stdlib_files(root):
        if path.relative_to(root).as_posix() == TOPICS:
            units += topic_units(path.read_text(encoding="utf-8"))
        else:
            units.append(path)
    random.Random(seed).shuffle(units)
    per_domain = None if max_chars is None else max_chars // 2
    per_unit = None if max_chars is None else max(2000, max_chars // 40)
    have = dict.fromkeys(DOMAINS, 0)
    out = []
    for unit in units:
        if per_domain is not None and all(have[d] >= per_domain for d in DOMAINS):
            break
        if isinstance(unit, Path):  # parsed lazily: a small budget reads few files
            try:
                with tokenize.open(unit) as fh:
                    unit = (unit.relative_to(root).as_posix(), file_documents(fh.read()))
            except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
                continue  # e.g. deliberately broken files; the walk stays deterministic
        src, docs = unit
        kept: dict[str, list[str]] = {}
        for d in DOMAINS:
            kept[d] = []
            used = 0
            for doc in docs[d]:
                if per_domain is not None and (have[d] >= per_domain or used >= per_unit):
                    break
                kept[d].append(doc)
                used += len(doc)
                have[d] += len(doc)
        if any(kept.values()):
            out.append((src, kept))
    return out


def split_files(units: list[tuple[str, dict[str, list[str]]]], frac: float = 0.05) -> dict[str, list]:
    """Assign whole units, in order, to valid / test / train so that valid and test each hold ~``frac``.

    A unit goes to the first held-out split whose share of the unit's main domain (its larger one)
    would stay at or below ``frac`` of that domain's running total with half the unit counted;
    otherwise to train. Running totals keep the shares right for every budget.
    """
    out: dict[str, list] = {s: [] for s in SPLITS}
    total = dict.fromkeys(DOMAINS, 0)
    held = {s: dict.fromkeys(DOMAINS, 0) for s in ("valid", "test")}
    for unit in units:
        size = {d: sum(len(x) for x in unit[1][d]) for d in DOMAINS}
        for d in DOMAINS:
            total[d] += size[d]
        main = max(DOMAINS, key=lambda d: size[d])
        split = next(
            (s for s in ("valid", "test") if held[s][main] + size[main] / 2 <= frac * total[main]), "train"
        )
        out[split].append(unit)
        if split != "train":
            for d in DOMAINS:
                held[split][d] += size[d]
    for split in SPLITS:
        for d in DOMAINS:
            if not any(docs[d] for _, docs in out[split]):
                raise ValueError(
                    f"the corpus is too small: split {split!r} has no {d!r} document; raise max_chars"
                )
    return out


def build_corpus(
    out: Path, max_chars: int | None = 6_000_000, seed: int = 0, frac: float = 0.05, root: Path | None = None
) -> str:
    """Write ``out/{train,valid,test}.jsonl`` (rows {"text", "domain", "source"}); return the content hash."""
    if max_chars is not None and max_chars < 50_000:
        raise ValueError(f"max_chars={max_chars}: must be at least 50000 (or None for the whole library)")
    if not 0 < frac < 0.5:
        raise ValueError(f"frac={frac}: must be in (0, 0.5)")
    parts = split_files(collect(max_chars, seed, root), frac)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        rows = [
            {"text": text, "domain": d, "source": src}
            for src, docs in parts[split]
            for d in DOMAINS
            for text in docs[d]
        ]
        random.Random(f"{seed}-{split}").shuffle(rows)  # interleave domains and modules
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return corpus_hash(out)


def corpus_hash(path: Path) -> str:
    h = hashlib.sha256()
    for split in SPLITS:
        h.update(split.encode())
        h.update((Path(path) / f"{split}.jsonl").read_bytes())
    return h.hexdigest()


def read_split(path: Path, split: str) -> list[dict]:
    """Rows of ``path/<split>.jsonl``."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: the tiny corpus has {', '.join(SPLITS)}")
    with open(Path(path) / f"{split}.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
