"""Pictures of the position encodings, computed with jaxpos and saved as PNGs.

1. ``sinusoid_table.png``: the sinusoidal table ``P[pos, i]`` (Vaswani et al. 2017, §3.5),
   128 positions by 64 features: fast clocks on the left, slow ones on the right.
2. ``sinusoid_similarity.png``: normalised similarity ``P[0] . P[k] / (d/2)`` against the
   offset ``k`` for base 100 and base 10,000 (d = 64). With base 10,000 it falls gradually
   (about 0.43 at k = 64 and 0.28 at k = 1,000); with base 100 the slowest wavelength is
   about 540 positions and both offsets look unrelated to position 0 (near 0).
3. ``t5_buckets.png``: T5's bucket of each relative offset ``kv - q`` (Raffel et al. 2020,
   §2.1), bidirectional (16 buckets per direction) and causal (32 for keys at or before
   the query): exact up to 7 (15 causal), logarithmic up to ``max_distance = 128``, then
   one shared bucket.
4. ``alibi_bias.png``: the causal ALiBi bias ``-m (i - j)`` for 3 of 8 heads (slopes
   1/2, 1/16, 1/256; Press et al. 2022, §3, Fig. 3), future keys masked.
5. ``rope_decay.png``: RoPE's long-term decay (Su et al. 2024, §3.4.3, Fig. 2): the
   relative upper bound ``(1/(d/2)) sum_j |S_j|``, ``S_j = sum_{i<j} exp(1j * m * theta_i)``,
   against the distance ``m``, and the score ``q_m . k_n / d`` of two all-ones vectors
   rotated with :func:`jaxpos.apply_rope` (d = 128, base 10,000).

It also writes ``encodings.png`` with all five panels, and prints the numbers that the
pictures show (``tests/docs/test_examples.py`` checks them against the papers' formulas).

Usage::

    python examples/plot_encodings.py [--out DIR]      # default runs/examples/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jaxpos


# ----------------------------------------------------------------------------- numbers
def sinusoid_similarity(offsets, d: int = 64, base: float = 10000.0) -> np.ndarray:
    """``P[0] . P[k] / (d / 2)`` for each offset ``k`` (float64 ``[len(offsets)]``)."""
    offsets = np.asarray(offsets)
    P = np.asarray(jaxpos.sinusoidal_pe(int(offsets.max()) + 1, d, base), np.float64)
    return P[offsets] @ P[0] / (d / 2)


def slowest_wavelength(d: int, base: float) -> float:
    """Wavelength in positions of the slowest sinusoid pair, ``2 pi base ** (1 - 2/d)``."""
    return 2 * np.pi * base ** (1 - 2 / d)


def rope_relative_upper_bound(distances, d: int = 128, base: float = 10000.0) -> np.ndarray:
    """Su et al. 2024, §3.4.3: ``(1/(d/2)) sum_{j=1}^{d/2} |S_j|``,
    ``S_j = sum_{i<j} e^{i m theta_i}``."""
    inv_freq = np.asarray(jaxpos.rope_frequencies(d, base)[0], np.float64)
    m = np.asarray(distances, np.float64)[:, None]
    S = np.cumsum(np.exp(1j * m * inv_freq[None, :]), axis=1)
    return np.abs(S).mean(axis=1)


def rope_ones_score(distances, d: int = 128, base: float = 10000.0) -> np.ndarray:
    """``q_m . k_0 / d`` for all-ones ``q`` and ``k`` rotated by :func:`jaxpos.apply_rope`."""
    distances = np.asarray(distances)
    inv_freq, _ = jaxpos.rope_frequencies(d, base)
    T = int(distances.max()) + 1
    x = jnp.ones((1, T, 1, d), jnp.float32)
    r = np.asarray(jaxpos.apply_rope(x, jnp.arange(T), inv_freq), np.float64)[0, :, 0]
    return r[distances] @ r[0] / d


def t5_buckets(offsets, bidirectional: bool) -> np.ndarray:
    """T5 buckets (``num_buckets=32, max_distance=128``) of ``offsets = kv - q``."""
    return np.asarray(jaxpos.t5_bucket(np.asarray(offsets, np.int32), bidirectional=bidirectional))


# ------------------------------------------------------------------------------ panels
def draw_sinusoid_table(ax, T: int = 128, d: int = 64):
    P = np.asarray(jaxpos.sinusoidal_pe(T, d))
    im = ax.imshow(P, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("feature i (pair i//2: sin, cos)")
    ax.set_ylabel("position")
    ax.set_title(f"Sinusoidal table, {T} positions x d = {d}", fontsize=9)
    ax.figure.colorbar(im, ax=ax, fraction=0.046)


def draw_sinusoid_similarity(ax, d: int = 64, K: int = 1200):
    k = np.arange(K + 1)
    for base, c in ((10000.0, "C0"), (100.0, "C3")):
        ax.plot(k, sinusoid_similarity(k, d, base), color=c, lw=1,
                label=f"base {base:g} (slowest wavelength {slowest_wavelength(d, base):,.0f})")
    for k0 in (64, 1000):
        ax.axvline(k0, color="0.5", ls=":", lw=1)
    ax.axhline(0, color="0.7", lw=0.8)
    ax.set_xlabel("offset k")
    ax.set_ylabel("P[0] . P[k] / (d/2)")
    ax.set_title(f"Sinusoid similarity against offset (d = {d})", fontsize=9)
    ax.legend(fontsize=7)


def draw_t5_buckets(ax, span: int = 160):
    rel = np.arange(-span, span + 1)
    ax.step(rel, t5_buckets(rel, True), where="mid", label="bidirectional (encoder)")
    ax.step(rel, t5_buckets(rel, False), where="mid", label="causal (decoder)")
    for x in (-128, 128):
        ax.axvline(x, color="0.6", ls=":", lw=1)
    ax.set_xlabel("relative offset kv - q")
    ax.set_ylabel("bucket")
    ax.set_title("T5 buckets (32 buckets, max_distance 128)", fontsize=9)
    ax.legend(fontsize=7)


def draw_alibi(axes, T: int = 16, num_heads: int = 8, heads=(0, 3, 7)):
    pos = np.arange(T)
    slopes = jaxpos.alibi_slopes(num_heads)
    bias = np.asarray(jaxpos.alibi_bias(pos, pos, slopes))
    causal = pos[None, :] <= pos[:, None]
    lo = float(np.min(np.where(causal, bias, 0)))
    for ax, h in zip(axes, heads):
        b = np.where(causal, bias[h], np.nan)
        im = ax.imshow(b, cmap="viridis", vmin=lo, vmax=0, aspect="equal", interpolation="nearest")
        ax.set_title(f"ALiBi head {h + 1}/{num_heads}, m = 1/{1 / float(slopes[h]):g}", fontsize=8)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    axes[-1].figure.colorbar(im, ax=axes[-1], fraction=0.046, label="bias (shared scale)")


def draw_rope_decay(ax, d: int = 128, M: int = 256):
    m = np.arange(M + 1)
    ax.plot(m, rope_relative_upper_bound(m, d), color="C0")
    ax.set_ylabel("relative upper bound (Su et al. Fig. 2)", color="C0", fontsize=8)
    right = ax.twinx()
    right.plot(m, rope_ones_score(m, d), color="C1", lw=0.9)
    right.set_ylabel("q_m . k_n / d, all-ones q and k", color="C1", fontsize=8)
    ax.set_xlabel("relative distance m - n")
    ax.set_title(f"RoPE long-term decay (d = {d}, base 10,000)", fontsize=9)


def save_all(out: Path) -> list[Path]:
    """Draw every panel to its own PNG and to ``encodings.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def single(name, draw, ncols=1, size=(5.2, 3.6)):
        fig, axes = plt.subplots(1, ncols, figsize=size, dpi=100)
        draw(axes)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        paths.append(out / name)

    single("sinusoid_table.png", draw_sinusoid_table)
    single("sinusoid_similarity.png", draw_sinusoid_similarity)
    single("t5_buckets.png", draw_t5_buckets)
    single("alibi_bias.png", draw_alibi, ncols=3, size=(10, 3.4))
    single("rope_decay.png", draw_rope_decay)

    fig = plt.figure(figsize=(14, 8), dpi=90)
    grid = fig.add_gridspec(2, 6)
    draw_sinusoid_table(fig.add_subplot(grid[0, 0:2]))
    draw_sinusoid_similarity(fig.add_subplot(grid[0, 2:4]))
    draw_t5_buckets(fig.add_subplot(grid[0, 4:6]))
    draw_alibi([fig.add_subplot(grid[1, i]) for i in range(3)])
    draw_rope_decay(fig.add_subplot(grid[1, 3:6]))
    fig.tight_layout()
    fig.savefig(out / "encodings.png")
    plt.close(fig)
    paths.append(out / "encodings.png")
    return paths


def report() -> dict:
    """Print and return the numbers behind the pictures."""
    sim = {base: sinusoid_similarity([64, 1000], 64, base) for base in (10000.0, 100.0)}
    waves = {base: slowest_wavelength(64, base) for base in (10000.0, 100.0)}
    rel = np.arange(0, 200)
    starts = [int(rel[np.argmax(t5_buckets(rel, True) == b)]) for b in range(17, 32)]
    causal_starts = [int(rel[np.argmax(t5_buckets(-rel, False) == b)]) for b in range(1, 32)]
    slopes = np.asarray(jaxpos.alibi_slopes(8))
    bound = rope_relative_upper_bound([0, 16, 64, 256])
    print("Sinusoidal, d = 64: P[0].P[k]/(d/2)")
    for base in (10000.0, 100.0):
        print(f"  base {base:>7g}: k=64 -> {sim[base][0]:+.3f}, k=1000 -> {sim[base][1]:+.3f}; "
              f"slowest wavelength {waves[base]:,.0f} positions")
    print("T5 bidirectional: first distance of buckets 1..15 after the query:", starts[:15])
    print("T5 causal: first distance of buckets 1..31 before the query:", causal_starts)
    print("ALiBi slopes, 8 heads:", " ".join(f"1/{1 / s:g}" for s in slopes))
    print("RoPE relative upper bound at distance 0, 16, 64, 256 (d = 128):",
          " ".join(f"{v:.2f}" for v in bound))
    return {"similarity": sim, "wavelength": waves, "t5_starts": starts,
            "t5_causal_starts": causal_starts, "alibi_slopes": slopes, "rope_bound": bound}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/examples", help="folder for the PNGs")
    args = p.parse_args(argv)
    report()
    for path in save_all(Path(args.out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
