"""LaTeX output: booktabs tables that compile on their own and can be `\\input` into a paper.

A table file tests whether a document class is already loaded (LaTeX redefines \\documentclass
to an error once one is): alone, it opens an article sized to the table; inside a document, it
is just the `table` float. The host document needs `\\usepackage{booktabs}`; with graphicx
loaded too, a table wider than the text is scaled to the text width.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_ESC = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "×": r"$\times$",
    "–": "--",
    "≥": r"$\geq$",
    "′": "$'$",
    "→": r"$\to$",
    "Δ": r"$\Delta$",
    "≠": r"$\neq$",
    "†": r"$\dagger$",
    "±": r"$\pm$",
    "∈": r"$\in$",
    "·": r"$\cdot$",
    "—": "---",
}
DASH = "--"  # the paper's "–": a non-finite number


def esc(s: object) -> str:
    """Escape text for LaTeX (and turn the few non-ASCII symbols we print into math)."""
    return "".join(_ESC.get(ch, ch) for ch in str(s))


def ascii_tex(s: str) -> str:
    """Cells are LaTeX already; only their non-ASCII symbols are translated (pdflatex rejects them)."""
    return "".join(_ESC.get(ch, ch) if ord(ch) > 127 else ch for ch in s)


def bold(s: str) -> str:
    return rf"\textbf{{{s}}}" if s else s


def fmt_ppl(v: float | None, kind: str | None = "finite") -> str:
    """Perplexity as the paper prints it: 20,633 · 120k · 6.3m; '--' when non-finite; '' when absent."""
    if kind not in (None, "finite"):
        return DASH
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if not math.isfinite(v):
        return DASH
    if v >= 1e6:
        return f"{v / 1e6:.1f}m"
    if v >= 1e5:
        return f"{v / 1e3:.0f}k"
    if v >= 1e3:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}"


def fmt_pct(v: float | None, digits: int = 2, signed: bool = False) -> str:
    """A percentage already in percent units."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def _plain_len(cell: str) -> int:
    s = re.sub(r"\\(textbf|emph|multicolumn)\{", "", cell)
    s = re.sub(r"\\[a-zA-Z]+|[{}$]", "", s)
    return len(s)


@dataclass
class Table:
    """One booktabs table: `head` and `rows` hold cells (strings) or a raw line such as a rule."""

    stem: str
    caption: str  # plain text, escaped on output
    colspec: str
    head: list[list[str] | str]
    rows: list[list[str] | str]
    index_caption: str = ""  # one line for the report index
    notes: list[str] = field(default_factory=list)  # plain-text lines under the table

    def _lines(self, rows: list[list[str] | str]) -> list[str]:
        return [ascii_tex(r if isinstance(r, str) else " & ".join(r) + r" \\") for r in rows]

    def size_cm(self) -> tuple[float, float]:
        """Paper size that holds the table when compiled alone (generous; the margin is blank)."""
        widths: dict[int, int] = {}
        for r in [*self.head, *self.rows]:
            if isinstance(r, list):
                for i, c in enumerate(r):
                    if "multicolumn" not in c:
                        widths[i] = max(widths.get(i, 0), _plain_len(c))
        width = max(14.0, 3.0 + sum(0.2 * w + 0.45 for w in widths.values()))
        per_line = max(width - 3.0, 1.0)
        text_lines = math.ceil(len(self.caption) * 0.19 / per_line) + sum(
            max(2, math.ceil(len(n) * 0.17 / per_line) + 1) for n in self.notes
        )
        height = 5.0 + 0.5 * (len(self.head) + len(self.rows)) + 0.5 * text_lines
        return round(width, 1), round(height, 1)

    def tex(self) -> str:
        w, h = self.size_cm()
        out = [
            f"% moesweep report table: {self.stem}",
            r"% Compiles alone (pdflatex); or \input it in a document that loads booktabs.",
            r"\expandafter\ifx\csname @twoclasseserror\endcsname\documentclass",
            r"  \expandafter\let\csname moesweepbegin\endcsname\relax",
            r"  \expandafter\let\csname moesweepend\endcsname\relax",
            r"\else",
            r"  \documentclass{article}",
            rf"  \usepackage[paperwidth={w}cm,paperheight={h}cm,margin=1.5cm]{{geometry}}",
            r"  \usepackage{booktabs}",
            r"  \usepackage{graphicx}",
            r"  \pagestyle{empty}",
            r"  \def\moesweepbegin{\begin{document}}",
            r"  \def\moesweepend{\end{document}}",
            r"\fi",
            r"\moesweepbegin",
            r"\begin{table}[htbp]",
            r"\centering",
            r"\small",
            rf"\caption{{{esc(self.caption)}}}",
            rf"\label{{tab:{self.stem.replace('_', '-')}}}",
            r"\expandafter\ifx\csname moesweepbox\endcsname\relax\newsavebox\moesweepbox\fi",
            r"\sbox\moesweepbox{%",
            rf"\begin{{tabular}}{{{self.colspec}}}",
            r"\toprule",
            *self._lines(self.head),
            r"\midrule",
            *self._lines(self.rows),
            r"\bottomrule",
            r"\end{tabular}}%",
            r"% wider than the text: scaled to fit when the document loads graphicx, else natural width",
            r"\expandafter\ifx\csname resizebox\endcsname\relax\usebox\moesweepbox\else",
            r"  \ifdim\wd\moesweepbox>\linewidth\resizebox{\linewidth}{!}{\usebox\moesweepbox}"
            r"\else\usebox\moesweepbox\fi",
            r"\fi",
        ]
        for n in self.notes:
            out += [r"\par\smallskip", rf"{{\footnotesize {esc(n)}}}"]
        out += [r"\end{table}", r"\moesweepend", ""]
        return ascii_tex("\n".join(out))
