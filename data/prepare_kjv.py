#!/usr/bin/python3
"""Prepares the King James Bible as token files for Lockstep's language-model job.

    data/prepare_kjv.py [OUT_DIR]        # default: build/data/kjv

Reads the whole text with Debian's `bible` reader (packages bible-kjv and
bible-kjv-text: `bible -p /usr/lib gen1:1-rev22:21`, 4,298,239 bytes), cuts it
into its 1,189 chapters, and writes bytes as tokens (vocabulary 256):

    OUT_DIR/train.bin   every chapter but every 20th, in order
    OUT_DIR/eval.bin    every 20th chapter (the 20th, 40th, ...): the held-out split
    OUT_DIR/meta.txt    byte counts, chapters and SHA-256 of each file

Each file is written to a temporary name and renamed, so a run that stops leaves
either the old files or the new ones. Nothing is fetched from a network. Exit 1
with one line naming the package when `bible` is missing or prints nothing.
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys

HELD_OUT_EVERY = 20
# A chapter starts with a line holding the book's name and the chapter's number
# ("Genesis 1", "1 Kings 3", "Song of Solomon 2") after a blank line.
HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]+ \d+$")


def fail(message):
    print(f"prepare_kjv: {message}", file=sys.stderr)
    sys.exit(1)


def read_bible():
    reader = shutil.which("bible")
    if reader is None:
        fail("the `bible` reader is missing; install it: apt-get install bible-kjv bible-kjv-text")
    proc = subprocess.run([reader, "-p", "/usr/lib", "gen1:1-rev22:21"], capture_output=True)
    if proc.returncode != 0 or len(proc.stdout) < 1_000_000:
        fail(f"`bible -p /usr/lib gen1:1-rev22:21` gave {len(proc.stdout)} bytes (exit {proc.returncode}); "
             "is bible-kjv-text installed? apt-get install bible-kjv bible-kjv-text")
    return proc.stdout


def chapters(text):
    lines = text.split(b"\n")
    starts = [i for i, line in enumerate(lines)
              if HEADING.match(line.decode("ascii", "replace")) and (i == 0 or lines[i - 1].strip() == b"")]
    if len(starts) < 1000:
        fail(f"found {len(starts)} chapter headings, expected 1,189: an unexpected text")
    # The blank line before a heading goes with the chapter it opens.
    bounds = [max(0, s - 1) if s > 0 else 0 for s in starts] + [len(lines)]
    bounds[0] = 0
    return [b"\n".join(lines[bounds[k]:bounds[k + 1]]) + (b"\n" if bounds[k + 1] < len(lines) else b"")
            for k in range(len(starts))]


def write(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv):
    out_dir = argv[1] if len(argv) > 1 else os.path.join("build", "data", "kjv")
    text = read_bible()
    parts = chapters(text)
    if b"".join(parts) != text:
        fail("the chapters do not add up to the text")
    train = b"".join(p for k, p in enumerate(parts) if (k + 1) % HELD_OUT_EVERY != 0)
    held_out = b"".join(p for k, p in enumerate(parts) if (k + 1) % HELD_OUT_EVERY == 0)
    os.makedirs(out_dir, exist_ok=True)
    write(os.path.join(out_dir, "train.bin"), train)
    write(os.path.join(out_dir, "eval.bin"), held_out)
    meta = (f"source: bible -p /usr/lib gen1:1-rev22:21 ({len(text)} bytes, {len(parts)} chapters)\n"
            f"tokens: bytes, vocabulary 256\n"
            f"train.bin: {len(train)} bytes, sha256 {hashlib.sha256(train).hexdigest()}\n"
            f"eval.bin: {len(held_out)} bytes (every {HELD_OUT_EVERY}th chapter), "
            f"sha256 {hashlib.sha256(held_out).hexdigest()}\n")
    write(os.path.join(out_dir, "meta.txt"), meta.encode())
    print(f"prepare_kjv: {out_dir}: train.bin {len(train)} bytes, eval.bin {len(held_out)} bytes "
          f"({len(parts)} chapters, every {HELD_OUT_EVERY}th held out)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
