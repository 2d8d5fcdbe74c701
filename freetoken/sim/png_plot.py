"""A small self-contained line-plot writer: RGB raster, 3x5 bitmap font, PNG via zlib.

Enough for miss-rate curves (axes, ticks, one coloured polyline per series with markers, a
legend) without a plotting library.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

# 3x5 glyphs, rows top to bottom, "1" = ink. Letters render as capitals.
_GLYPHS = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001011001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001010010",
    "8": "111101111101111",
    "9": "111101111001111",
    "a": "010101111101101",
    "b": "110101110101110",
    "c": "011100100100011",
    "d": "110101101101110",
    "e": "111100110100111",
    "f": "111100110100100",
    "g": "011100101101011",
    "h": "101101111101101",
    "i": "111010010010111",
    "j": "001001001101010",
    "k": "101101110101101",
    "l": "100100100100111",
    "m": "101111111101101",
    "n": "110101101101101",
    "o": "010101101101010",
    "p": "110101110100100",
    "q": "010101101111011",
    "r": "110101110101101",
    "s": "011100010001110",
    "t": "111010010010010",
    "u": "101101101101111",
    "v": "101101101101010",
    "w": "101101111111101",
    "x": "101101010101101",
    "y": "101101010010010",
    "z": "111001010100111",
    ".": "000000000000010",
    "%": "101001010100101",
    "-": "000000111000000",
    ":": "000010000010000",
    "/": "001001010100100",
    "=": "000111000111000",
    "(": "010100100100010",
    ")": "010001001001010",
    "_": "000000000000111",
    " ": "000000000000000",
}
PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75)]
_BLACK, _GREY, _WHITE = (0, 0, 0), (215, 215, 215), (255, 255, 255)


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.px[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        for y in range(y0, y1 + 1):
            for x in range(x0, x1 + 1):
                self.dot(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int], width: int = 1) -> None:
        """Bresenham, thickened to a `width` x `width` pen."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        lo = -(width // 2)
        while True:
            self.rect(x0 + lo, y0 + lo, x0 + lo + width - 1, y0 + lo + width - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = _BLACK, scale: int = 2) -> int:
        """Draw `s` with its top-left at (x, y); returns the x after it."""
        for ch in s.lower():
            bits = _GLYPHS.get(ch, _GLYPHS[" "])
            for i, b in enumerate(bits):
                if b == "1":
                    cx, cy = x + (i % 3) * scale, y + (i // 3) * scale
                    self.rect(cx, cy, cx + scale - 1, cy + scale - 1, color)
            x += 4 * scale
        return x

    def png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.px))


def text_width(s: str, scale: int = 2) -> int:
    return len(s) * 4 * scale - scale


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG (no interlace, filter 0 on every row)."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"expected {width * height * 3} bytes of RGB, got {len(rgb)}")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def _fmt(v: float, percent: bool) -> str:
    return f"{v:.0%}" if percent else f"{v:g}"


def line_plot(
    path: str | Path,
    series: dict[str, Sequence[tuple[float, float] | None]],
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    x_range: tuple[float, float] = (0.0, 1.0),
    y_range: tuple[float, float] = (0.0, 1.0),
    width: int = 720,
    height: int = 440,
    ticks: int = 5,
    x_percent: bool = False,
) -> Path:
    """Plot each series (points in x order; None breaks the line) and write a PNG."""
    cv = Canvas(width, height)
    left, right, top, bottom = 70, width - 170, 40, height - 56
    (x0, x1), (y0, y1) = x_range, y_range

    def px(x: float, y: float) -> tuple[int, int]:
        fx = (x - x0) / (x1 - x0) if x1 != x0 else 0.0
        fy = (y - y0) / (y1 - y0) if y1 != y0 else 0.0
        return round(left + fx * (right - left)), round(bottom - fy * (bottom - top))

    for i in range(ticks):
        fx = x0 + (x1 - x0) * i / (ticks - 1)
        fy = y0 + (y1 - y0) * i / (ticks - 1)
        gx, _ = px(fx, y0)
        _, gy = px(x0, fy)
        cv.line(gx, top, gx, bottom, _GREY)
        cv.line(left, gy, right, gy, _GREY)
        label = _fmt(fx, x_percent)
        cv.text(gx - text_width(label) // 2, bottom + 8, label)
        label = _fmt(fy, False)
        cv.text(left - 8 - text_width(label), gy - 5, label)
    cv.line(left, top, left, bottom, _BLACK)
    cv.line(left, bottom, right, bottom, _BLACK)
    cv.text((left + right - text_width(title)) // 2, 12, title)
    cv.text((left + right - text_width(x_label)) // 2, bottom + 30, x_label)
    cv.text(8, top - 22, y_label)
    for n, (name, points) in enumerate(series.items()):
        color = PALETTE[n % len(PALETTE)]
        prev = None
        for p in points:
            if p is None:
                prev = None
                continue
            cur = px(*p)
            if prev is not None:
                cv.line(*prev, *cur, color, width=2)
            cv.rect(cur[0] - 2, cur[1] - 2, cur[0] + 2, cur[1] + 2, color)
            prev = cur
        ly = top + 10 + 22 * n
        cv.line(right + 16, ly + 4, right + 40, ly + 4, color, width=3)
        cv.text(right + 48, ly, name)
    path = Path(path)
    path.write_bytes(cv.png())
    return path
