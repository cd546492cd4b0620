"""Draw the documentation's one picture, docs/img/concepts.svg: fibers, error feedback and what an allgather
carries at W ranks. Plain SVG text, no plotting library; tests/test_docs.py checks the file is this script's
output.

    .venv/bin/python scripts/docs_figure.py            # writes docs/img/concepts.svg
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "img" / "concepts.svg"
ROWS, COLS, K, CELL = 6, 10, 2, 18


def svg() -> str:
    rnd = random.Random(7)
    grad = [[rnd.gauss(0, 1) for _ in range(COLS)] for _ in range(ROWS)]
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="760" height="250" font-family="sans-serif" '
             'font-size="12">', '<rect width="760" height="250" fill="white"/>']
    text = parts.append

    # 1. the gradient matrix, one fiber per row, its k largest magnitudes kept
    x0, y0 = 20, 40
    text(f'<text x="{x0}" y="24" font-weight="bold">1. Fibers: each row keeps its top {K}</text>')
    for r, row in enumerate(grad):
        keep = sorted(range(COLS), key=lambda c: -abs(row[c]))[:K]
        for c, v in enumerate(row):
            fill = "#d9534f" if c in keep else "#e8e8e8"
            text(f'<rect x="{x0 + c * CELL}" y="{y0 + r * CELL}" width="{CELL - 2}" height="{CELL - 2}" '
                 f'fill="{fill}"/>')
        text(f'<text x="{x0 + COLS * CELL + 4}" y="{y0 + r * CELL + 12}" fill="#555">fiber {r}</text>')
    text(f'<text x="{x0}" y="{y0 + ROWS * CELL + 18}" fill="#555">red: sent this round; grey: kept in the</text>')
    text(f'<text x="{x0}" y="{y0 + ROWS * CELL + 32}" fill="#555">residual for the next round</text>')

    # 2. error feedback
    x1 = 290
    text(f'<text x="{x1}" y="24" font-weight="bold">2. Error feedback, per rank</text>')
    boxes = [("gradient g", 50), ("a = g + r", 95), ("send top-k of a", 140), ("r = a - sent", 185)]
    for label, y in boxes:
        text(f'<rect x="{x1}" y="{y}" width="150" height="28" rx="4" fill="#f4f4f4" stroke="#888"/>')
        text(f'<text x="{x1 + 10}" y="{y + 18}">{label}</text>')
    for (_, y), (_, y2) in zip(boxes, boxes[1:]):
        text(f'<line x1="{x1 + 75}" y1="{y + 28}" x2="{x1 + 75}" y2="{y2}" stroke="#333" marker-end="url(#a)"/>')
    text(f'<path d="M {x1 + 150} {199} C {x1 + 200} 199, {x1 + 200} 109, {x1 + 150} 109" fill="none" '
         'stroke="#d9534f" marker-end="url(#a)"/>')
    text(f'<text x="{x1 + 160}" y="158" fill="#d9534f">next round</text>')
    text('<defs><marker id="a" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
         '<path d="M0,0 L8,4 L0,8 z" fill="#333"/></marker></defs>')

    # 3. wire bytes at W ranks
    x2 = 530
    text(f'<text x="{x2}" y="24" font-weight="bold">3. Wire bytes at W = 4 ranks</text>')
    text(f'<text x="{x2}" y="50" fill="#555">allgather: each rank receives</text>')
    text(f'<text x="{x2}" y="64" fill="#555">the other W - 1 payloads</text>')
    for i in range(3):
        text(f'<rect x="{x2 + i * 34}" y="74" width="30" height="20" fill="#d9534f"/>')
    text(f'<text x="{x2 + 110}" y="89">(W-1) P</text>')
    text(f'<text x="{x2}" y="126" fill="#555">ring allreduce of the dense</text>')
    text(f'<text x="{x2}" y="140" fill="#555">gradient D, each way</text>')
    text(f'<rect x="{x2}" y="150" width="{int(150 * 2 * 3 / 4)}" height="20" fill="#888"/>')
    text(f'<text x="{x2 + 120}" y="165" fill="white">2(W-1)/W D</text>')
    text(f'<text x="{x2}" y="200" fill="#555">payload bytes: P, one rank\'s message;</text>')
    text(f'<text x="{x2}" y="214" fill="#555">wire bytes: what its link carries</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(svg())
    print(f"wrote {OUT.relative_to(OUT.parent.parent.parent)}", file=sys.stderr)
