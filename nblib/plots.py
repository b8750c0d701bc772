"""matplotlib figures for the notebooks; the only nblib module that imports pyplot.

Every function returns a `Figure` and, given `save_to`, also writes it as a PNG (150 dpi) so
headless runs leave figures under `outputs/figures`. Sections follow the notebooks.
"""
from __future__ import annotations

import functools
import statistics
import textwrap
from pathlib import Path

import matplotlib

if not matplotlib.get_backend().lower().startswith(("module://matplotlib_inline", "nbagg", "ipympl", "widget")):
    matplotlib.use("Agg")  # headless: scripts and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

GB = 1e9
MB = 1e6


def finish(fig: Figure, save_to: str | Path | None = None, *, legend: dict | None = None,
           grid: str | None = None) -> Figure:
    """Readable log ticks, a tight layout and, if asked, a PNG; returns the figure.

    `legend`: its options, for a legend on every axis that has labelled artists; `grid`: "major" or "both", a
    light grid on every axis.
    """
    for ax in fig.axes:
        if legend is not None and ax.get_legend_handles_labels()[0]:
            ax.legend(**legend)
        if grid is not None:
            ax.grid(alpha=0.3, which=grid)
    readable_log_ticks(fig)
    fig.tight_layout()
    if save_to is not None:
        path = Path(save_to)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150)
    return fig


def readable_log_ticks(fig: Figure) -> None:
    """Every log axis gets ticks at 1, 2, 5 x 10^k written as plain numbers (3 MB, not 3x10^0).

    Axes whose ticks a figure set itself (a FixedLocator, e.g. the batch sizes) keep them, as plain numbers.
    """
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale != "log":
                continue
            low, high = sorted(axis.get_view_interval())
            decades = math.log10(high / low) if low > 0 else math.inf    # 1, 2, 5 per decade crowd a wide axis
            if not isinstance(axis.get_major_locator(), FixedLocator):
                axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2 else (1.0,)))
            axis.set_major_formatter(FuncFormatter(_plain_number))
            axis.set_minor_formatter(NullFormatter())


def _plain_number(value: float, _pos=None) -> str:
    """A tick label short enough not to run into its neighbour: 500, 2k, 50k, 1M (0.5 below 1)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def close(fig: Figure) -> None:
    """Release a figure that was already displayed (widgets redraw many)."""
    plt.close(fig)


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 3.8):
    """A figure with a grid of axes sized for a notebook cell."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes.ravel() if nrows * ncols > 1 else axes[0, 0]


# ============================================================ 01 memory budgeting (budget.py)
# (owned by the budget work; keep functions for other notebooks in their own section)


def budget_bars(budget, save_to=None, top: int = 4) -> Figure:
    """One stacked bar per resource (VRAM, RAM, local disk, Drive) against its limit, verdict on top."""
    from nblib.budget import RESOURCES

    fig, axes = new_figure(ncols=4, width=3.0, height=4.2)
    for ax, resource in zip(axes, RESOURCES):
        lines = sorted(budget.lines[resource], key=lambda ln: -ln.bytes)
        shown, rest = lines[:top], sum(ln.bytes for ln in lines[top:])
        names = [line.name for line in shown] + ([] if not rest else ["other lines"])
        colors = line_colors(names)
        bottom = 0.0
        for name, line in zip(names, shown + ([] if not rest else [None])):
            gb = (line.bytes if line else rest) / GB
            ax.bar(0, gb, bottom=bottom, width=0.6, color=colors[name], label=name)
            bottom += gb
        limit = budget.limits[resource] / GB
        if limit:
            ax.axhline(limit, color="crimson", ls="--", lw=1.5, label=f"limit {limit:.1f} GB")
            ax.set_ylim(0, max(bottom, limit) * 1.15)
        ax.set_title(f"{resource}: {bottom:.2f} GB" + (f"\n{bottom / limit:.0%} of limit" if limit else ""),
                     fontsize=9, color="crimson" if resource in budget.over else "black")   # resources.fits
        ax.set_xticks([])
        ax.set_ylabel("GB")
        if not lines:
            ax.text(0, 0.5, "not used", ha="center", transform=ax.get_yaxis_transform())
            continue
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.02), frameon=False)
    fig.suptitle(textwrap.fill(budget.headline, 120), fontsize=9,
                 color="darkgreen" if budget.fits else "crimson")
    return finish(fig, save_to)


def line_colors(names) -> dict:
    """A colour per budget line, fixed by the line's name: a redraw never changes what a colour means.

    The colour is the name's crc32 in tab20 without its greys; two names of one bar that land on the
    same colour take the next free one, in the order given; "other lines" is always grey.
    """
    import zlib

    tab20 = plt.get_cmap("tab20").colors
    grey, palette = tab20[15], [c for i, c in enumerate(tab20) if i not in (14, 15)]   # grey only for the rest
    taken, out = set(), {}
    for name in names:
        if name == "other lines":
            out[name] = grey
            continue
        index = zlib.crc32(name.encode()) % len(palette)
        while index in taken:
            index = (index + 1) % len(palette)
        taken.add(index)
        out[name] = palette[index]
    return out


def predicted_vs_measured(batch_sizes, predicted, measured, *, what: str = "peak RSS increase",
                          save_to=None) -> Figure:
    """Predicted and measured memory against batch size, the measured MB and the ratio written at each point."""
    fig, ax = new_figure(width=6.4, height=4.0)
    ax.plot(batch_sizes, [p / MB for p in predicted], "o--", label="predicted (budget)")
    ax.plot(batch_sizes, [m / MB for m in measured], "s-", label="measured")
    for b, p, m in zip(batch_sizes, predicted, measured):
        ax.annotate(f"{m / MB:,.1f} MB, {m / p:.2f}x", (b, m / MB), textcoords="offset points", xytext=(6, -12),
                    fontsize=8)
    ax.set_xscale("log", base=2)
    ax.margins(x=0.12, y=0.15)
    ax.set(yscale="log", xticks=list(batch_sizes), xlabel="batch size", ylabel=f"{what} (MB)",
           title=f"{what}: measured, and measured / predicted, at each point")
    return finish(fig, save_to, legend={}, grid="both")


def shuffle_checkpoint_plot(rows, disk_bytes: float | None = None, save_to=None) -> Figure:
    """tf.data checkpoint size and peak disk during its save against the shuffle buffer size."""
    fig, ax = new_figure(width=6.4, height=4.0)
    xs = [r.buffer_size for r in rows]
    ax.plot(xs, [r.checkpoint_bytes / GB for r in rows], "o-", label="checkpoint")
    ax.fill_between(xs, [r.peak_disk_first_save / GB for r in rows], [r.peak_disk_keeping_previous / GB for r in rows],
                    alpha=0.3, color="tab:orange", label="peak disk during save (first save - previous kept)")
    if disk_bytes:
        ax.axhline(disk_bytes / GB, color="crimson", ls="--", label=f"free disk {disk_bytes / GB:.0f} GB")
    ax.set(xscale="log", yscale="log", xlabel="shuffle buffer (samples)", ylabel="GB",
           title=f"tf.data shuffle checkpoint at {rows[0].sample_bytes / 1e3:.0f} KB/sample")
    return finish(fig, save_to, legend={"fontsize": 8}, grid="both")


def shard_plan_plot(plans, save_to=None) -> Figure:
    """Shard count and RAM of loading one shard at a time against the target shard size."""
    fig, ax = new_figure(width=6.4, height=4.0)
    xs = [p.target_shard_bytes / MB for p in plans]
    ax.plot(xs, [p.n_shards for p in plans], "o-", color="tab:blue", label="shards")
    ax.set(xscale="log", yscale="log", xlabel="target shard size (MB)")
    ax.set_ylabel("number of shards", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [p.ram_one_at_a_time / GB for p in plans], "s--", color="tab:red",
             label="RAM, one shard + one prefetched")
    ax2.set_ylabel("RAM (GB)", color="tab:red")
    ax.axvspan(400, 500, color="green", alpha=0.15, label="reference choice 400-500 MB")
    ax.set_title(f"sharding a {plans[0].total_bytes / GB:.0f} GB file "
                 f"(all at once: {plans[0].ram_all_at_once / GB:.0f} GB of RAM)")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center")
    return finish(fig, save_to)


# ============================================================ 02 cache population (cache.py)


def image_grid(images, titles=None, ncols: int = 6, cell_inches: float = 1.6,
               save_to=None) -> Figure:
    """Rendered images in a grid, each with an optional small title (e.g. the text's kind)."""
    n = len(images)
    nrows = max(1, -(-n // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(cell_inches * ncols, (cell_inches + 0.25) * nrows),
                             squeeze=False)
    for k, ax in enumerate(axes.ravel()):
        ax.axis("off")
        if k < n:
            ax.imshow(images[k], interpolation="nearest")
            if titles is not None:
                ax.set_title(_printable(str(titles[k])[:24]), fontsize=7, fontfamily=_shipped_font_families())
    return finish(fig, save_to)


def _printable(title: str) -> str:
    """A title matplotlib can draw: controls become spaces, characters no shipped font has become '?'."""
    from nblib.render import has_glyph

    return "".join(" " if not c.isprintable() else c if has_glyph(c) else "?" for c in title)


@functools.lru_cache(maxsize=1)
def _shipped_font_families() -> list[str]:
    """The render font chain (data/fonts) registered with matplotlib, as a fallback list of family names.

    Titles then draw Thai, Devanagari and CJK with real glyphs (matplotlib does not shape, so Arabic
    shows unjoined letters), instead of boxes.
    """
    from matplotlib import font_manager

    from nblib.render import FONTS_DIR, SHIPPED_FONTS

    families = []
    for name in SHIPPED_FONTS:
        path = FONTS_DIR / name
        if path.is_file():
            font_manager.fontManager.addfont(str(path))
            families.append(font_manager.FontProperties(fname=str(path)).get_name())
    return families or ["DejaVu Sans"]


def cache_disk_plan(plans: dict, free_bytes: float, save_to=None) -> Figure:
    """Predicted cache size per codec (a CachePlan each) against the free disk."""
    fig, ax = new_figure(width=6.5, height=3.4)
    names = list(plans)
    sizes = [plans[c].predicted_bytes / GB for c in names]
    bars = ax.barh(names, sizes, color=["tab:red" if s * GB > free_bytes else "tab:green" for s in sizes])
    ax.axvline(free_bytes / GB, color="black", linestyle="--", label=f"free disk {free_bytes / GB:,.0f} GB")
    ax.bar_label(bars, [f" {size:,.1f} GB" for size in sizes], fontsize=8)
    first = plans[names[0]]
    ax.set(xlabel="predicted cache size (GB)", xlim=(0, max(sizes + [free_bytes / GB]) * 1.25),
           title=f"{first.n_images:,} images at {first.image_size} px: which codec fits?")
    return finish(fig, save_to, legend={"loc": "lower right", "fontsize": 8})


def cache_worker_scaling(rates, save_to=None, *, cores: int | None = None, load: float | None = None) -> Figure:
    """Render throughput per worker count: medians with their min-max range, and linear from 1 worker.

    `rates` maps worker count to an `nblib.compare.Spread` (a lab `Scaling.rates`); the machine's `cores` and
    1-minute `load` average while measuring (a lab `Scaling`'s) go in the linear line's label: it needs idle cores.
    """
    fig, ax = new_figure(width=5.5, height=3.6)
    workers = list(rates)
    med = [rates[w].median for w in workers]
    err = [[m - rates[w].low for w, m in zip(workers, med)], [rates[w].high - m for w, m in zip(workers, med)]]
    ax.errorbar(workers, med, yerr=err, fmt="o-", capsize=4, label=f"measured (median, range of {rates[workers[0]].n})")
    busy = "" if None in (cores, load) else f"\nload caps it: {cores} cores, load average {load:.1f} while measuring"
    ax.plot(workers, [med[0] * w / workers[0] for w in workers], ":", color="gray",
            label=f"ideal (linear): one free core per worker{busy}")
    for w, r in zip(workers, med):
        ax.annotate(f"{r:,.0f}", (w, r), textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.set(xlabel="render workers (processes)", ylabel="images / s", xticks=workers,
           ylim=(0, max([rates[w].high for w in workers] + [med[0] * workers[-1] / workers[0]]) * 1.15),
           title="cache population throughput")
    return finish(fig, save_to, legend={"fontsize": 8})


def cache_read_throughput(rates: dict, consumer_images_per_s: float | None = None,
                          save_to=None) -> Figure:
    """Read images/s per access pattern (log scale), optionally against what a consumer needs."""
    fig, ax = new_figure(width=7.5, height=0.45 * len(rates) + 1.4)
    names = list(rates)
    bars = ax.barh(names, [rates[n] for n in names], color="tab:purple")
    ax.bar_label(bars, [f" {rates[n]:,.0f}/s" for n in names], fontsize=8)
    if consumer_images_per_s:
        ax.axvline(consumer_images_per_s, color="black", linestyle="--")
        ax.text(consumer_images_per_s, len(names) - 0.45, f" encoder needs ~{consumer_images_per_s:,.0f}/s",
                fontsize=8, va="bottom")
    ax.set(ylim=(-0.6, len(names) + 0.2), xscale="log", xlabel="images / s (log scale)",
           xlim=(min(list(rates.values()) + [consumer_images_per_s or float("inf")]) / 3, max(rates.values()) * 20),
           title="reading the cache back")
    return finish(fig, save_to)


# ============================================================ 03 streaming encoding (encode.py)


def encode_throughput(timeline, part_samples: int | None = None, resumed_at: int = 0,
                      title: str = "streaming encode", save_to=None) -> Figure:
    """Samples done and per-batch samples/s over time, from an EncodeReport's timeline."""
    import numpy as np

    t = np.array([0.0] + [p[0] for p in timeline])
    done = np.array([0] + [p[1] for p in timeline]) + resumed_at
    fig, (ax_done, ax_rate) = new_figure(ncols=2, width=5.2)
    ax_done.plot(t, done, marker=".", ms=3)
    if part_samples:
        for k in range(1, int(done[-1] // part_samples) + 1):
            ax_done.axhline(k * part_samples, color="0.85", lw=0.8, zorder=0)
    ax_done.set(xlabel="seconds", ylabel="samples encoded",
                title="progress" + (" (grey: part boundaries)" if part_samples else ""))
    rate = np.diff(done) / np.maximum(np.diff(t), 1e-9)
    ax_rate.plot(t[1:], rate, lw=1, label="per batch")
    if len(rate) >= 2:
        mean = (done[-1] - done[0]) / max(t[-1], 1e-9)
        ax_rate.axhline(mean, color="C3", ls="--", label=f"mean {mean:,.0f}/s")
    top = float(np.percentile(rate, 95)) * 1.3 if len(rate) >= 5 else None
    clipped = int((rate > top).sum()) if top else 0
    if clipped:       # a short last batch or a timer tick can read 10x the rest and squash the axis
        ax_rate.plot([], [], " ", label=f"{clipped} batch(es) above {top:,.0f}/s not shown")
    ax_rate.set(xlabel="seconds", ylabel="samples / s", title="throughput over time",
                ylim=(0, top if clipped else None))
    fig.suptitle(title)
    return finish(fig, save_to, legend={"loc": "best"})


def sketch_projection(coords, explained, save_to=None) -> Figure:
    """2-D PCA of the sketches, one colour per capsule: do capsules carry different views?"""
    fig, ax = new_figure(width=5.5, height=4.5)
    for c in range(coords.shape[1]):
        ax.scatter(coords[:, c, 0], coords[:, c, 1], s=6, alpha=0.6, label=f"capsule {c}")
    ax.set(xlabel=f"PC1 ({explained[0]:.0%} of variance)",
           ylabel=f"PC2 ({explained[1]:.0%} of variance)",
           title=f"sketches of {coords.shape[0]:,} images, PCA to 2-D")
    return finish(fig, save_to, legend={"markerscale": 2, "fontsize": 8, "ncol": 2 if coords.shape[1] > 6 else 1})


def checksum_hamming(collisions, save_to=None) -> Figure:
    """Histogram of pairwise Hamming distances between checksum codes; 0 is a collision."""
    import numpy as np

    fig, ax = new_figure(width=6.0, height=3.8)
    h = collisions.hamming
    ax.hist(h, bins=np.arange(-0.5, collisions.bits + 1.5, max(1, collisions.bits // 64)),
            color="C0")
    ax.axvline(collisions.bits / 2, color="0.5", ls=":", label=f"unrelated codes: {collisions.bits // 2} bits")
    ax.set(xlabel=f"Hamming distance between {collisions.bits}-bit codes",
           ylabel="pairs of images", xlim=(-1, collisions.bits + 1),
           title=f"{(h == 0).sum():,} colliding pairs among {len(h):,}")
    return finish(fig, save_to, legend={})


def encode_disk_projection(choices, save_to=None) -> Figure:
    """Disk of a full run per output choice (`nblib.lab.streaming_encoding.full_run_disk`) against its disks.

    Filled bar: the outputs (one copy: the parts, what a Drive holds); outline: what the local disk holds (the
    parts and the consolidated copy). Colour: the budget's verdict (`DiskChoice.fitting`, within 90% of each
    disk): green fits every disk, orange some, red none.
    """
    fig, ax = new_figure(width=8.0, height=4.2)
    labels = [c.label for c in choices]
    disks = list(choices[0].needs)
    values = [c.outputs_bytes / GB for c in choices]
    local = [c.needs[disks[0]] / GB for c in choices]
    colors = ["C2" if len(c.fitting) == len(disks) else "C1" if c.fitting else "C3" for c in choices]
    ax.barh(labels, local, fill=False, edgecolor=colors, ls=":", label=f"{disks[0]}: parts + consolidated copy")
    bars = ax.barh(labels, values, color=colors)
    for bar, v in zip(bars, values):
        ax.text(bar.get_width() * 1.05, bar.get_y() + bar.get_height() / 2, f"{v:,.1f} GB",
                va="center", fontsize=8)
    for i, disk in enumerate(disks):
        limit = choices[0].limits[disk] / GB
        ax.axvline(limit, color=f"C{i + 4}", ls="--", label=f"{disk}: {limit:,.0f} GB")
    ax.set(xlabel="GB on disk (log scale)", xscale="log", xlim=(min(values) / 2, max(local) * 4),
           title="full run: outputs on disk per choice\nthe budget's verdict (10% margin):\n"
                 "green fits every disk, orange some, red none")
    ax.invert_yaxis()
    return finish(fig, save_to, legend={"loc": "lower right", "fontsize": 8, "framealpha": 0.95})


# ============================================================ 04 shuffle checkpoints (shuffle.py, tfdata.py)

def tf_checkpoint_vs_buffer(rows, state_rows=(), save_to=None) -> Figure:
    """tf.data checkpoint bytes and save seconds against buffer size: plain, symbolic, ours."""
    fig, (size_ax, time_ax) = new_figure(ncols=2)
    series = {}
    for r in rows:
        if r.error:
            continue
        label = f"{r.pipeline}, symbolic" if r.symbolic and r.pipeline == "tf.data shuffle" else r.pipeline
        series.setdefault(label, []).append((r.buffer_size, r.bytes_on_disk, r.save_s))
    for row in state_rows:
        series.setdefault(f"resumable ({row.algorithm}): state JSON", []).append(
            (row.buffer_size, row.state_bytes, row.save_s))
    styles = {"tf.data shuffle": "o-", "tf.data shuffle, symbolic": "s--"}
    for label, points in series.items():
        b, size, secs = zip(*sorted(points))
        size_ax.plot(b, size, styles.get(label, "^-"), label=label)
        time_ax.plot(b, secs, styles.get(label, "^-"), label=label)
    sample = next((r for r in rows if r.pipeline == "tf.data shuffle"), None)
    if sample is not None:
        b = sorted({r.buffer_size for r in rows})
        size_ax.plot(b, [x * sample.sample_bytes for x in b], ":", color="grey",
                     label=f"buffer x {sample.sample_bytes:,} B")
    size_ax.set(xscale="log", yscale="log", xlabel="shuffle buffer (samples)", ylabel="checkpoint bytes on disk",
                title="What one iterator checkpoint writes")
    time_ax.set(xscale="log", yscale="log", xlabel="shuffle buffer (samples)", ylabel="save seconds",
                title="How long the save takes")
    return finish(fig, save_to, legend={"fontsize": 7})


def tf_reference_extrapolation(extrapolation, ram_bytes: float | None = None, disk_bytes: float | None = None,
                               save_to=None) -> Figure:
    """The reference rows (buffer x 500 kB, its temporary-space range) beside the fitted prediction, in GB; the
    Colab lines are the t4 device's RAM and disk (nblib.budget.DEVICES, the limits every budget uses) unless given.
    """
    import numpy as np

    from nblib.budget.devices import DEVICES

    ram_bytes = DEVICES["t4"].ram_bytes if ram_bytes is None else ram_bytes
    disk_bytes = DEVICES["t4"].disk_bytes if disk_bytes is None else disk_bytes

    fig, ax = new_figure(width=8.0)
    x = np.arange(len(extrapolation))
    width = 0.2
    ref = [e.reference_bytes / GB for e in extrapolation]
    ref_hi = [e.reference_peak_bytes[1] / GB for e in extrapolation]
    ours = [e.predicted_bytes / GB for e in extrapolation]
    rot = [e.predicted_rotating_peak / GB for e in extrapolation]
    ax.bar(x - 1.5 * width, ref, width, label="reference: checkpoint")
    ax.bar(x - 0.5 * width, ref_hi, width, label="reference: peak during save (upper end)")
    ax.bar(x + 0.5 * width, ours, width, label="measured fit: checkpoint")
    ax.bar(x + 1.5 * width, rot, width, label="budget model: peak, previous checkpoint kept")
    ax.axhline(ram_bytes / GB, color="red", ls="--", lw=1, label=f"Colab RAM {ram_bytes / GB:.1f} GB")
    ax.axhline(disk_bytes / GB, color="black", ls=":", lw=1, label=f"Colab local disk {disk_bytes / GB:.0f} GB")
    ax.set_xticks(x, [f"{e.buffer_size:,}" for e in extrapolation])
    ax.set(yscale="log", xlabel="shuffle buffer (samples of ~500 kB)", ylabel="GB (1e9 bytes)",
           title="Reference table vs. extrapolated measurements")
    return finish(fig, save_to, legend={"fontsize": 7, "loc": "upper left"})


def shuffle_quality_vs_buffer(rows, target_share: float | None = None, save_to=None) -> Figure:
    """Same-episode neighbour share and rank correlation against buffer size, per algorithm."""
    fig, (share_ax, rank_ax) = new_figure(ncols=2)
    by_algorithm = {}
    for r in rows:
        by_algorithm.setdefault(r.algorithm, []).append(r)
    styles = {"tf.data shuffle": "o-", "resumable (buffer)": "x--", "resumable (global)": "-"}
    for name, group in by_algorithm.items():
        group = sorted(group, key=lambda r: r.buffer_size)
        b = [r.buffer_size for r in group]
        share_ax.plot(b, [r.same_episode_share for r in group], styles.get(name, "-"), label=name)
        rank_ax.plot(b, [r.spearman for r in group], styles.get(name, "-"), label=name)
    first = rows[0]
    b = sorted({r.buffer_size for r in rows})
    k = first.episode_len
    share_ax.plot(b, [k / (k + 2 * x) for x in b], ":", color="grey", label="rule: k / (k + 2B)")
    share_ax.axhline(first.same_episode_share_random, color="black", ls="-.", lw=0.8,
                     label="full shuffle (k-1)/(n-1)")
    if target_share is not None:
        share_ax.axhline(target_share, color="red", ls="--", lw=0.8, label=f"target {target_share:.0%}")
    share_ax.set(xscale="log", yscale="log", xlabel="shuffle buffer B (samples)",
                 ylabel="neighbours from the same episode",
                 title=f"Episodes of k={k} consecutive samples, n={first.n_samples:,}")
    rank_ax.set(xscale="log", xlabel="shuffle buffer B (samples)", ylabel="Spearman(position, source index)",
                title="Order left over (1 = unshuffled, 0 = random)")
    return finish(fig, save_to, legend={"fontsize": 7})


# ============================================================ 05 input pipeline (pipeline/, lab/input_pipeline.py)


def pipeline_knob_curves(table, knobs=None, highlight=None, save_to=None) -> Figure:
    """samples/s (left axis) and data-wait (right axis) against each knob a sweep varied alone.

    `highlight`: a row of the table, starred on each curve it lies on (the widget's pick).
    """
    from nblib.pipeline.sweep import knob_text

    knobs = [k for k in (knobs or table.knobs) if len(table.curve(k)) > 1]
    ncols = min(3, len(knobs)) or 1
    nrows = -(-len(knobs) // ncols) or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax, knob in zip(axes.ravel(), knobs):
        curve = table.curve(knob)
        xs = range(len(curve))
        ax.errorbar(xs, [r["samples_per_s"] for r in curve], fmt="o-", color="C0", capsize=3,
                    yerr=[[r["samples_per_s"] - r.get("low", r["samples_per_s"]) for r in curve],
                          [r.get("high", r["samples_per_s"]) - r["samples_per_s"] for r in curve]])
        ax.set_xticks(list(xs), [knob_text(r[knob]) for r in curve])
        ax.set(xlabel=knob, ylabel="samples/s")
        ax.set_ylim(bottom=0)
        wait = ax.twinx()
        wait.plot(xs, [r["data_wait"] for r in curve], "s--", color="C3")
        wait.set(ylim=(0, 1.05))
        wait.set_ylabel("data-wait (share of step)", color="C3")
        base = next(i for i, r in enumerate(curve) if r["varied"] == "base")
        ax.axvline(base, color="grey", lw=0.6, ls=":")
        if highlight is not None and highlight in curve:
            i = curve.index(highlight)
            ax.plot([i], [highlight["samples_per_s"]], "*", color="gold", markersize=16, markeredgecolor="black")
    for ax in axes.ravel()[len(knobs):]:
        ax.set_visible(False)
    return finish(fig, save_to)


def pipeline_memory(table, trap_rows, buffer_knob: str = "shuffle_buffer", save_to=None) -> Figure:
    """Peak RSS against the shuffle buffer (tf.data sweep), and RAM added against torch workers running TF."""
    fig, (buf_ax, work_ax) = new_figure(ncols=2, width=5.0)
    curve = table.curve(buffer_knob) if buffer_knob in table.knobs else []
    buf_ax.plot([r[buffer_knob] for r in curve], [r["peak_rss_bytes"] / MB for r in curve], "o-")
    buf_ax.set(xlabel=buffer_knob, ylabel="peak RSS (MB)", title="tf.data: peak RSS against the shuffle buffer")
    traps = [r for r in trap_rows if r["setup"].startswith("TF in")]
    work_ax.plot([r["num_workers"] for r in traps], [r["rss_added_bytes"] / MB for r in traps], "o-",
                 label="TF pipeline in each worker")
    for i, r in enumerate(r for r in trap_rows if not r["setup"].startswith("TF in")):
        work_ax.plot([r["num_workers"]], [r["rss_added_bytes"] / MB], "s^"[i % 2], label=r["setup"])
    work_ax.set(xlabel="torch num_workers", ylabel="RAM added (MB)", title="The per-worker TF trap")
    from matplotlib.ticker import MaxNLocator

    work_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (buf_ax, work_ax):      # from 0: a truncated axis would turn a few MB of drift into a trend
        low, high = ax.get_ylim()
        ax.set_ylim(min(0.0, low), max(high, 1.0) * 1.1)
    return finish(fig, save_to, legend={"fontsize": 7})


def mixing_bars(mixing, save_to=None) -> Figure:
    """samples/s of one dataset, 4 mixed by sample_from_datasets, and the fix, with the 80% recovery line."""
    fig, ax = new_figure(width=6.5)
    names = ["one dataset", "4 sources:\nsample_from_datasets", "4 sources:\ninterleave, then decode"]
    rates = [mixing.single, mixing.mixed, mixing.fixed]
    spreads = [mixing.spread(k) for k in ("single", "mixed", "fixed")]
    ax.bar(names, rates, color=["C0", "C3", "C2"], capsize=4,
           yerr=[[r - s.low for r, s in zip(rates, spreads)], [s.high - r for r, s in zip(rates, spreads)]])
    ax.axhline(0.8 * mixing.single, color="black", ls="--", lw=0.8, label="80% of one dataset")
    ax.set(ylabel=f"samples/s (median, range of {mixing.repeats} runs)",
           title=f"Mixing under a parallelism budget of {mixing.budget}")
    return finish(fig, save_to, legend={"fontsize": 8})


def input_rates(rows, encoder_samples_per_s: float, encoder_label: str = "encoder", save_to=None) -> Figure:
    """samples/s of each input source (bars: median, whiskers: the runs' range) against the encoder's rate."""
    fig, ax = new_figure(width=6.5)
    med = [float(statistics.median(r.get("runs", [r["samples_per_s"]]))) for r in rows]
    low = [m - min(r.get("runs", [m])) for r, m in zip(rows, med)]
    high = [max(r.get("runs", [m])) - m for r, m in zip(rows, med)]
    names = [textwrap.fill(r["source"], 18) for r in rows]
    bars = ax.bar(names, med, yerr=[low, high], capsize=4, color="C0")
    for bar, m in zip(bars, med):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{m:,.0f}/s ", ha="right", va="bottom",
                fontsize=8)
    ax.axhline(encoder_samples_per_s, color="C3", ls="--",
               label=f"{textwrap.fill(encoder_label, 60)}: {encoder_samples_per_s:,.0f}/s")
    ax.set(ylabel="samples/s (median, range of runs)", title="Can the loader feed the encoder?")
    ax.set_ylim(0, max(max(m + h for m, h in zip(med, high)), encoder_samples_per_s) * 1.2)
    below_names = -0.1 - 0.08 * max(name.count("\n") + 1 for name in names)   # under the bars' names: no line covered
    return finish(fig, save_to, legend={"fontsize": 7, "loc": "upper center", "bbox_to_anchor": (0.5, below_names)})


# ============================================================ 06 training (nblib.train)


def training_curves(history, chance: float, save_to=None) -> Figure:
    """A run's recorded evaluations (`TrainReport.history`) by step: training and held-out loss, and held-out
    accuracy against chance (the step-0 row has no training loss: it is taken before the first step).
    """
    fig, (loss_ax, acc_ax) = new_figure(ncols=2, width=5.0, height=3.4)
    steps = [h["step"] for h in history]
    trained = [h for h in history if h["train_loss"] == h["train_loss"]]     # NaN at step 0: no batch yet
    loss_ax.plot([h["step"] for h in trained], [h["train_loss"] for h in trained], "o-",
                 label="training loss (the step's batch)")
    loss_ax.plot(steps, [h["heldout_loss"] for h in history], "s-", label="held-out loss")
    acc_ax.plot(steps, [100 * h["heldout_accuracy"] for h in history], "s-", color="tab:green", label="held-out")
    acc_ax.axhline(100 * chance, color="gray", ls="--", label=f"chance ({100 * chance:.1f}%)")
    loss_ax.set(xlabel="optimizer step", ylabel="cross-entropy", title="loss")
    acc_ax.set(xlabel="optimizer step", ylabel="accuracy (%)", title="held-out accuracy", ylim=(0, 100))
    return finish(fig, save_to, legend={"fontsize": 8}, grid="major")


# ============================================================ 07 your model (nblib.lab.your_model)


def model_budget_vs_simulated(checks: dict, limit_bytes: float | None = None, save_to=None) -> Figure:
    """Reserved VRAM against batch per job ({"encoding": [BudgetCheck, ...], ...}): budget and simulation."""
    fig, ax = new_figure(width=6.4, height=4.0)
    for i, (job, rows) in enumerate(checks.items()):
        rows = sorted(rows, key=lambda r: r.batch)
        batches = [r.batch for r in rows]
        ax.plot(batches, [r.budget.reserved / GB for r in rows], "o--", color=f"C{i}", label=f"{job}: budget (traced)")
        ax.plot(batches, [r.simulated.max_reserved / GB for r in rows], "s", color=f"C{i}", mfc="none", ms=11,
                label=f"{job}: simulated loop")
    if limit_bytes:
        ax.axhline(limit_bytes / GB, color="C3", lw=1, label="T4 limit less margin and CUDA context")
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="batch size", ylabel="reserved VRAM, GB (simulated T4)",
           title="Budget against the simulated loop (simulated T4, no GPU)")
    return finish(fig, save_to, legend={"fontsize": 7}, grid="both")


# ============================================================ 06 training: scoring a run (nblib.train.evaluate)


def confusion_matrix(matrix, classes, *, title: str = "", save_to=None) -> Figure:
    """Counts [true class, predicted class] as a heat map, each cell written; rows: true, columns: predicted."""
    import numpy as np

    matrix = np.asarray(matrix)
    side = min(12.0, 2.5 + 0.45 * len(classes))
    fig, ax = new_figure(width=side, height=side * 0.85)
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, label="images")
    ticks = range(len(classes))
    ax.set_xticks(ticks, [_printable(str(c)) for c in classes], rotation=90 if len(classes) > 6 else 0)
    ax.set_yticks(ticks, [_printable(str(c)) for c in classes])
    if len(classes) <= 30:
        cut = matrix.max(initial=0) / 2
        for (i, j), count in np.ndenumerate(matrix):
            ax.text(j, i, f"{count:,}", ha="center", va="center", fontsize=8,
                    color="white" if count > cut else "black")
    ax.set(xlabel="predicted class", ylabel="true class")
    ax.set_title(_printable(title or "confusion matrix"), fontsize=9)
    return finish(fig, save_to)
