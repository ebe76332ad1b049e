#!/usr/bin/env python3
"""Writes COUNT random mutations of a text-format config for the fault suite.

Each mutant applies one to three edits: a number replaced by an extreme or
malformed one, an identifier or string replaced, a line deleted, duplicated or
swapped, a field name misspelt, the file cut short, random bytes inserted.
Usage: mutate_config.py CONFIG OUT_DIR COUNT SEED  (writes OUT_DIR/mutant_NNN.textproto)
"""
import random
import re
import sys

NUMBERS = ["0", "-1", "1", "2147483647", "-2147483648", "9223372036854775807", "99999999999999999999",
           "1e308", "-1e308", "1e-320", "nan", "inf", "-inf", "0.5", "3.7", "0x10", "1e", "--2", "", "007"]
WORDS = ["", "SGD", "ADAM", "mlp", "cnn", "SYNTHETIC", "FASHION_MNIST", "COSINE", "nonsense", "true", "false",
         "\"\"", "\"/nonexistent/dir\"", "\"../../etc\"", "\"" + "x" * 5000 + "\"", "{", "}", ":", "\"\\x00\""]


def mutate(lines, rng):
    kind = rng.randrange(9)
    if not lines:
        return lines
    i = rng.randrange(len(lines))
    line = lines[i]
    if kind == 0 and re.search(r":\s*-?[0-9.]", line):
        lines[i] = re.sub(r"(:\s*)(-?[0-9][0-9.eE+-]*)", lambda m: m.group(1) + rng.choice(NUMBERS), line, count=1)
    elif kind == 1 and ":" in line:
        key = line.split(":", 1)[0]
        lines[i] = key + ": " + rng.choice(WORDS + NUMBERS)
    elif kind == 2:
        del lines[i]
    elif kind == 3:
        lines.insert(i, line)
    elif kind == 4:
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == 5 and re.search(r"[a-z_]+", line):
        lines[i] = re.sub(r"[a-z_]+", lambda m: m.group(0)[:-1] + "x", line, count=1)
    elif kind == 6:
        text = "\n".join(lines)
        return text[: rng.randrange(len(text) + 1)].split("\n")
    elif kind == 7:
        noise = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(1, 32), rng.randrange(128, 0x3000)]))
                        for _ in range(rng.randrange(1, 12)))
        pos = rng.randrange(len(line) + 1)
        lines[i] = line[:pos] + noise + line[pos:]
    else:  # a top-level field appended (later fields win), so that it reaches validation
        lines.append(rng.choice(["model { hidden_units: %s }" % rng.choice(NUMBERS),
                                    "optimizer { learning_rate: %s }" % rng.choice(NUMBERS),
                                    "data { global_batch_size: %s }" % rng.choice(NUMBERS),
                                    "checkpoint { keep_last: %s }" % rng.choice(NUMBERS),
                                    "unknown_field: 1", "model {", "}"]))
    return lines


def main():
    config, out_dir, count, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    base = open(config, encoding="utf-8").read().split("\n")
    rng = random.Random(seed)
    for n in range(count):
        lines = list(base)
        for _ in range(rng.randrange(1, 4)):
            lines = mutate(lines, rng)
        with open("%s/mutant_%03d.textproto" % (out_dir, n), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write("\n".join(lines))
    print("wrote %d mutants of %s (seed %d)" % (count, config, seed))


if __name__ == "__main__":
    main()
