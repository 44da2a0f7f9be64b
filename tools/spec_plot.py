"""The figure of `ddtree bench spec`: τ and speedup vs tree budget, written as a PNG.

matplotlib when installed; otherwise a built-in rasterizer (3x5 pixel font, lines, markers) and a
minimal PNG writer (zlib + crc32), so the bench needs nothing beyond numpy.
"""

from __future__ import annotations

import math
from pathlib import Path

from tools.spec_report import CHAIN, DDTREE


def plot(rows: list[dict], path: Path) -> str:
    """τ and speedup vs budget per (harness, temperature); chain as a dashed reference line."""
    series = {}
    for r in rows:
        if r["mode"] in (CHAIN, DDTREE):
            key = (r["harness"], r["temperature"])
            series.setdefault(key, {"ddtree": [], "chain": None})
            if r["mode"] == DDTREE:
                series[key]["ddtree"].append((r["budget"], r["tau"], r.get("speedup_vs_ar") or 0.0))
            else:
                series[key]["chain"] = (r["tau"], r.get("speedup_vs_ar") or 0.0)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_raster(series, path)
        return "builtin"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (harness, temp), s in sorted(series.items()):
        pts = sorted(s["ddtree"])
        label = f"{harness} T={temp:g}"
        for ax, idx in ((axes[0], 1), (axes[1], 2)):
            line, = ax.plot([p[0] for p in pts], [p[idx] for p in pts], marker="o", label=f"DDTree {label}")
            if s["chain"] is not None:
                ax.axhline(s["chain"][idx - 1], ls="--", color=line.get_color(), alpha=0.6, label=f"chain {label}")
    for ax, title in ((axes[0], "mean acceptance length τ"), (axes[1], "speedup vs AR (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget N")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


# A 3x5 pixel font for the built-in rasterizer (rows top to bottom, 3 bits each).
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "=": "000111000111000",
    "-": "000000111000000", " ": "000000000000000", "a": "000011101101011", "b": "100110101101110",
    "c": "000011100100011", "d": "001011101101011", "e": "000111111100011", "g": "011101011001110",
    "h": "100110101101101", "i": "010000010010010", "k": "100101110101101", "l": "010010010010010",
    "n": "000110101101101", "o": "000010101101010", "p": "000110101110100", "r": "000011100100100",
    "s": "000011110001110", "t": "010111010010011", "u": "000101101101011", "v": "000101101101010",
    "x": "000101010101101", "y": "101101011001110", "w": "000101101111101", "f": "011100110100100",
    "m": "000111111101101", "q": "000011101011001", "j": "001000001001110", "z": "000111001010111",
    "T": "111010010010010", "N": "101111111111101", "A": "010101111101101", "R": "110101110101101",
}
_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _plot_raster(series: dict, path: Path, width: int = 900, height: int = 380) -> None:
    import numpy as np

    img = np.full((height, width, 3), 255, dtype=np.uint8)

    def text(x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s:
            glyph = _FONT.get(ch, _FONT.get(ch.lower(), _FONT[" "]))
            for k, bit in enumerate(glyph):
                if bit == "1":
                    r, c = divmod(k, 3)
                    img[y + r * scale:y + (r + 1) * scale, x + c * scale:x + (c + 1) * scale] = color
            x += 4 * scale

    def line(x0, y0, x1, y1, color, dashed=False, thick=1):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n):
            if dashed and (i // 6) % 2:
                continue
            x = int(round(x0 + (x1 - x0) * i / max(n - 1, 1)))
            y = int(round(y0 + (y1 - y0) * i / max(n - 1, 1)))
            img[max(y - thick + 1, 0):y + thick, max(x - thick + 1, 0):x + thick] = color

    budgets = sorted({b for s in series.values() for b, _, _ in s["ddtree"]}) or [1, 2]
    lo_b, hi_b = math.log2(budgets[0]), math.log2(budgets[-1]) if budgets[-1] > budgets[0] else math.log2(budgets[0]) + 1
    for panel, (idx, title) in enumerate(((1, "tau"), (2, "speedup vs ar"))):
        x0, y0, w, h = 60 + panel * 450, 30, 360, 290
        vals = [p[idx] for s in series.values() for p in s["ddtree"]]
        vals += [s["chain"][idx - 1] for s in series.values() if s["chain"] is not None]
        vmax = max(vals + [1.0]) * 1.1
        line(x0, y0 + h, x0 + w, y0 + h, (0, 0, 0))
        line(x0, y0, x0, y0 + h, (0, 0, 0))
        text(x0 + w // 2 - 40, 8, title)
        for k in range(5):
            v = vmax * k / 4
            y = y0 + h - int(h * v / vmax)
            line(x0 - 4, y, x0, y, (0, 0, 0))
            text(x0 - 42, y - 5, f"{v:.1f}")
        for b in budgets:
            x = x0 + int(w * (math.log2(b) - lo_b) / (hi_b - lo_b))
            line(x, y0 + h, x, y0 + h + 4, (0, 0, 0))
            text(x - 6, y0 + h + 8, str(b))
        text(x0 + w // 2 - 30, y0 + h + 26, "budget n")
        for ci, (key, s) in enumerate(sorted(series.items())):
            color = _COLORS[ci % len(_COLORS)]
            pts = sorted(s["ddtree"])
            xy = [(x0 + int(w * (math.log2(q[0]) - lo_b) / (hi_b - lo_b)), y0 + h - int(h * q[idx] / vmax)) for q in pts]
            for (ax, ay), (bx, by) in zip(xy, xy[1:]):
                line(ax, ay, bx, by, color, thick=2)
            for ax, ay in xy:
                img[ay - 3:ay + 4, ax - 3:ax + 4] = color
            if s["chain"] is not None:
                y = y0 + h - int(h * s["chain"][idx - 1] / vmax)
                line(x0, y, x0 + w, y, color, dashed=True)
            if panel == 0:
                text(x0 + 10, y0 + 6 + 14 * ci, f"{key[0]} t={key[1]:g}", color)
    _write_png(path, img)


def _write_png(path: Path, img) -> None:
    import struct
    import zlib

    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)
