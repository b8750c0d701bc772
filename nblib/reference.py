"""The reference figures the suite checks, as data: each one with its value, unit and source.

Five groups: the published streaming analysis of the `seed_t4` encode job, the tf.data
checkpoint-size table, the tf.data tuning log, the Colab limits the reference assumes, and
Google Drive's own limits (items per folder, uploads per day, the free quota) from Google's pages.
Values are as quoted (decimal units: 1 MB = 1e6 B, 1 GB = 1e9 B); a range is a tuple. No
verdicts here: `nblib.lab` compares them with the budget and the measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

ANALYSIS_SOURCE = "reference streaming-encode analysis of seed_t4 (1,907,747 images, batch 192, Colab T4)"
CHECKPOINT_SOURCE = 'reference checkpoint table "Why are dataloader checkpoints so large"'
TUNING_SOURCE = "reference tf.data tuning log (input pipeline of a training run on a Colab T4)"
COLAB_SOURCE = "Colab free tier as the reference describes it"
COLAB_FAQ_SOURCE = ("Colab FAQ, 'Drive timeouts' (https://research.google.com/colaboratory/faq.html): "
                    "operations time out when a folder directly holds thousands of items")
DRIVE_HELP_SOURCE = ("Google Drive Help, 'Files you can store in Google Drive' "
                     "(https://support.google.com/drive/answer/37603)")
GOOGLE_ONE_SOURCE = ("Google One Help, 'How your Google storage works' "
                     "(https://support.google.com/googleone/answer/9312312)")


@dataclass(frozen=True)
class ReferenceFigure:
    """One quoted figure: a number (or a (low, high) range, or a setting), its unit and source."""

    name: str
    value: float | tuple | str
    unit: str
    source: str
    note: str = ""


def _by_name(*figures: ReferenceFigure) -> dict[str, ReferenceFigure]:
    return {f.name: f for f in figures}


def _analysis(name: str, value, unit: str, note: str = "") -> ReferenceFigure:
    return ReferenceFigure(name, value, unit, ANALYSIS_SOURCE, note)


ANALYSIS = _by_name(
    _analysis("parameters", 14.9e6, "params"),
    _analysis("weights fp32 (encoder)", 60e6, "B"),
    _analysis("weights fp32 (capsules)", 20e6, "B", "quoted as '~20 MB capsules' beside the 60 MB"),
    _analysis("input images per batch", 55e6, "B"),
    _analysis("patches per batch", 113e6, "B"),
    _analysis("attention scores per batch (math)", 471e6, "B", "quoted as 192 x 8 x 196 x 196 x 4 B"),
    _analysis("activation peak", 1.5e9, "B", "quoted as ~1.5 GB"),
    _analysis("outputs per batch", 35e6, "B", "[B,12,768] + [B,12,32] + [B,12,4,768]"),
    _analysis("outputs held on GPU (50 batches)", 1.75e9, "B"),
    _analysis("VRAM total", 4e9, "B", "quoted as ~4 GB"),
    _analysis("outputs in RAM (200 batches, fp16)", 8.9e9, "B", "the run died after ~200 batches with this in RAM"),
    _analysis("RAM peak (capped)", 3.5e9, "B", "quoted as ~3.5 GB"),
    _analysis("image cache", 40e9, "B", "quoted as ~40 GB"),
    _analysis("checkpoint part", 3.6e9, "B"),
    _analysis("checkpoint parts", 50, "parts"),
    _analysis("checkpoints total", 180e9, "B", "quoted as 50 x 3.6 GB = 180 GB"),
    _analysis("seconds per batch", 2.04, "s", "measured on a T4, fp32"),
    _analysis("samples per second", 94, "samples/s", "measured on a T4, fp32"),
    _analysis("run time", 5.6, "h"),
)

CHECKPOINT_TABLE = _by_name(
    ReferenceFigure("shuffle buffers", (10_000, 50_000, 250_000, 400_000), "samples", CHECKPOINT_SOURCE,
                    "the rows of the table"),
    ReferenceFigure("sample size", 500_000, "B", CHECKPOINT_SOURCE, "quoted as ~500 KB per sample"),
    ReferenceFigure("checkpoint of 250,000 samples", 125e9, "B", CHECKPOINT_SOURCE,
                    "250,000 x 500 KB; a checkpoint = buffer x sample bytes"),
    ReferenceFigure("temporary space during a save", (1.5, 2.0), "x checkpoint", CHECKPOINT_SOURCE,
                    "quoted as 'the save needs 1.5-2x that in temporary space'"),
)

TUNING_LOG = _by_name(
    ReferenceFigure("input pipeline share of step time", (0.75, 0.83), "share", TUNING_SOURCE),
    ReferenceFigure("rate at batch 24", 74, "samples/s", TUNING_SOURCE),
    ReferenceFigure("rate at batch 128", 148, "samples/s", TUNING_SOURCE, "batch 24 -> 128 doubled the rate"),
    ReferenceFigure("rate mixing 4 datasets", (148, 205), "samples/s", TUNING_SOURCE,
                    "the log pairs them as 'mixing 4 datasets: 148 vs 205 samples/s'"),
    ReferenceFigure("num_parallel_calls tried", (128, 64), "calls", TUNING_SOURCE, "both logged as slower"),
    ReferenceFigure("AUTOTUNE", "tf.data.AUTOTUNE", "setting", TUNING_SOURCE, "logged as slower"),
    ReferenceFigure("RSS with larger shuffle buffers", (9.0e9, 15.8e9), "B", TUNING_SOURCE,
                    "RSS grew from 9.0 to 15.8 GB as the shuffle buffers grew"),
    ReferenceFigure("RAM per torch worker", 6e9, "B", TUNING_SOURCE,
                    "~6 GB per DataLoader worker, each building its own TF pipeline"),
)

COLAB = _by_name(
    ReferenceFigure("T4 VRAM", 15e9, "B", COLAB_SOURCE, "as Colab shows it"),
    ReferenceFigure("RAM", 12.7e9, "B", COLAB_SOURCE),
    ReferenceFigure("usable RAM", 11e9, "B", COLAB_SOURCE, "after the OS and the notebook server"),
    ReferenceFigure("local disk", (70e9, 100e9), "B", COLAB_SOURCE),
    ReferenceFigure("runtime limit", 12, "h", COLAB_SOURCE, "at most; often less"),
    ReferenceFigure("Drive quota", 15e9, "B", COLAB_SOURCE, "a free Google account"),
)

DRIVE = _by_name(
    ReferenceFigure("items per folder", 2_000, "items", COLAB_FAQ_SOURCE,
                    "the FAQ says 'thousands of items' make mounts and listings time out; 2,000 is the "
                    "smallest 'thousands' (Drive's hard limit, 500,000 items per folder, is far above)"),
    ReferenceFigure("upload per day", 750e9, "B", DRIVE_HELP_SOURCE,
                    "750 GB per user per day between My Drive and all shared drives; past it no new "
                    "upload starts until the next day (uploads in progress complete)"),
    ReferenceFigure("free quota", 15e9, "B", GOOGLE_ONE_SOURCE,
                    "15 GB at no charge, shared by Drive, Gmail and Google Photos"),
)

GROUPS = {"analysis": ANALYSIS, "checkpoint table": CHECKPOINT_TABLE, "tuning log": TUNING_LOG,
          "colab": COLAB, "drive": DRIVE}
