"""A small synthetic LongBench-style dataset, deterministic and offline: passages with planted facts.

    python -m eval.data.make_synthetic [--out eval/data/synthetic.jsonl] [--samples 4] [--paragraphs 8]

Each line has LongBench's fields (``context``, ``input``, ``answers``, ``dataset``, ``length``,
``all_classes``, ``_id``). Three tasks, ``--samples`` of each:

* ``synthetic_qa`` (F1): every paragraph plants an access code for a differently coloured door;
  the question asks for one door's code.
* ``synthetic_summary`` (ROUGE-L): one paragraph reports an event; the question asks what happened.
* ``synthetic_classify`` (exact match): every paragraph is about one topic; the question asks
  for the topic among four labels.

Paragraphs are separated by blank lines, so the harness can split them into modules.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

OUT = Path(__file__).resolve().parent / "synthetic.jsonl"

NAMES = "Alice Bruno Chen Dara Emil Farah Goran Hana Ivan Julia Kofi Lena Marco Nadia Omar Priya".split()
PLACES = "harbour museum station market library bakery garden bridge castle temple square tower".split()
CITIES = "Lisbon Oslo Kyoto Lima Nairobi Quebec Porto Seville Hanoi Krakow Tunis Bergen".split()
COLOURS = "red blue green yellow purple orange black white grey silver golden brown".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
TOPICS = {
    "sports": ("team", "match", "goal", "coach", "stadium", "league", "referee", "season"),
    "weather": ("rain", "storm", "wind", "cloud", "forecast", "temperature", "snow", "sunshine"),
    "cooking": ("recipe", "oven", "flour", "sauce", "kitchen", "spice", "dough", "onion"),
    "music": ("concert", "guitar", "melody", "choir", "drum", "song", "orchestra", "rhythm"),
}
VERBS = "visited described mentioned noticed praised discussed remembered photographed".split()


def filler(rng: random.Random, words: tuple[str, ...] | None = None, n: int = 5) -> str:
    """``n`` plain sentences, optionally about a topic's words."""
    out = []
    for _ in range(n):
        thing = rng.choice(words) if words else rng.choice(PLACES)
        out.append(f"{rng.choice(NAMES)} {rng.choice(VERBS)} the {thing} near the {rng.choice(PLACES)} in "
                   f"{rng.choice(CITIES)} on {rng.choice(DAYS)}.")
    return " ".join(out)


def qa_sample(rng: random.Random, paragraphs: int, i: int) -> dict:
    colours = rng.sample(COLOURS, paragraphs)
    codes = [str(rng.randint(1000, 9999)) for _ in colours]
    paras = [f"{filler(rng, n=2)} The access code for the {c} door is {k}. {filler(rng, n=2)}"
             for c, k in zip(colours, codes)]
    j = rng.randrange(paragraphs)
    return dict(context="\n\n".join(paras), input=f"What is the access code for the {colours[j]} door?",
                answers=[codes[j]], dataset="synthetic_qa", all_classes=None, _id=f"qa-{i}")


def retrieval_sample(rng: random.Random, notes: int = 8, i: int = 0) -> dict:
    """``notes`` short notes (one filler sentence, one 4-digit access code, one filler sentence);
    the question asks for one door's code. ``notes`` is a list of the notes' texts, ``answer`` the
    code, ``target`` the index of the note that holds it."""
    colours = rng.sample(COLOURS, notes)
    codes = [str(rng.randint(1000, 9999)) for _ in colours]
    texts = [f"Note {k + 1}. {filler(rng, n=1)} The access code for the {c} door is {code}. {filler(rng, n=1)}"
             for k, (c, code) in enumerate(zip(colours, codes))]
    j = rng.randrange(notes)
    return dict(notes=texts, input=f"What is the access code for the {colours[j]} door?", answer=codes[j],
                answers=[codes[j]], target=j, dataset="synthetic_retrieval", _id=f"retrieval-{i}")


def retrieval_samples(samples: int, notes: int = 8, seed: int = 0) -> list[dict]:
    """``samples`` retrieval samples (see ``retrieval_sample``), the same for the same arguments."""
    rng = random.Random(seed)
    return [retrieval_sample(rng, notes, i) for i in range(samples)]


def pair_samples(samples: int, notes: int = 8, seed: int = 0) -> list[dict]:
    """The second task of a different kind: the retrieval notes, but the question asks for TWO
    doors' codes, so the answer needs two documents (``answers``: both codes; correct when the
    output holds both). ``target`` is the first of the two notes."""
    rng, out = random.Random(seed), []
    for i in range(samples):
        s = retrieval_sample(rng, notes, i)
        colours = [re.search(r"for the (\w+) door", t).group(1) for t in s["notes"]]
        codes = [re.search(r"door is (\d+)", t).group(1) for t in s["notes"]]
        j, k = s["target"], rng.choice([x for x in range(notes) if x != s["target"]])
        out.append(dict(notes=s["notes"], input=f"What are the access codes for the {colours[j]} door and the "
                                                 f"{colours[k]} door?", answer=codes[j], answers=[codes[j], codes[k]],
                        target=j, dataset="synthetic_pairs", _id=f"pairs-{i}"))
    return out


def plain_sentence(rng: random.Random) -> str:
    """A filler sentence that names no person (``filler``'s names would be decoys for ``memo_samples``)."""
    return f"The {rng.choice(PLACES)} in {rng.choice(CITIES)} opened on {rng.choice(DAYS)}."


def memo_samples(samples: int, records: int = 3, seed: int = 0) -> list[dict]:
    """The second retrieval-study task, of another kind than one note's code: two documents per
    answer. ``records`` staff records ("Nadia works at the museum. The locker code of Nadia is
    4821.") and one delivery memo ("The parcel is for the person who works at the museum.") as
    ``records + 1`` documents; the question ("The memo says who the parcel is for. What is the
    locker code of that person?") names neither the person nor the place, so the answer's record
    is chosen by a clue in another document (two hops: memo -> place -> record). ``answers``: the
    code; ``target``: the record's index. SmolLM2-135M-Instruct answers about half at full
    prefill (chance: 1 / ``records``), so what a cache keeps of it is measurable."""
    rng, out = random.Random(seed), []
    for i in range(samples):
        names, places = rng.sample(NAMES, records), rng.sample(PLACES, records)
        codes = [str(rng.randint(1000, 9999)) for _ in names]
        j = rng.randrange(records)
        texts = [f"Staff record. {n} works at the {p}. The locker code of {n} is {c}. {plain_sentence(rng)}"
                 for n, p, c in zip(names, places, codes)]
        texts.append(f"Delivery memo. {plain_sentence(rng)} The parcel is for the person who works at the "
                     f"{places[j]}. {plain_sentence(rng)}")
        out.append(dict(notes=texts, input="The memo says who the parcel is for. What is the locker code of that "
                                           "person?", answer=codes[j], answers=[codes[j]], target=j,
                        dataset="synthetic_memo", _id=f"memo-{i}"))
    return out


def summary_sample(rng: random.Random, paragraphs: int, i: int) -> dict:
    who, where, city, day = rng.choice(NAMES), rng.choice(PLACES), rng.choice(CITIES), rng.choice(DAYS)
    event = f"{who} opened a new {where} in {city} on {day}."
    paras = [filler(rng, n=5) for _ in range(paragraphs)]
    j = rng.randrange(paragraphs)
    paras[j] = f"{filler(rng, n=2)} {event} {filler(rng, n=2)}"
    return dict(context="\n\n".join(paras), input=f"In one sentence, what did {who} do?", answers=[event],
                dataset="synthetic_summary", all_classes=None, _id=f"summary-{i}")


def classify_sample(rng: random.Random, paragraphs: int, i: int) -> dict:
    topic = rng.choice(sorted(TOPICS))
    paras = [filler(rng, TOPICS[topic], n=5) for _ in range(paragraphs)]
    labels = ", ".join(sorted(TOPICS))
    return dict(context="\n\n".join(paras),
                input=f"Which topic are the passages about? Answer with one word from: {labels}.",
                answers=[topic], dataset="synthetic_classify", all_classes=sorted(TOPICS), _id=f"classify-{i}")


def generate(samples: int = 4, paragraphs: int = 8, seed: int = 0) -> list[dict]:
    """``samples`` samples of each task, the same for the same arguments."""
    rng, rows = random.Random(seed), []
    for make in (qa_sample, summary_sample, classify_sample):
        for i in range(samples):
            row = make(rng, paragraphs, i)
            row["length"] = len(row["context"].split())
            row["language"] = "en"
            rows.append(row)
    return rows


def write(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--samples", type=int, default=4, help="samples per task")
    ap.add_argument("--paragraphs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = write(generate(args.samples, args.paragraphs, args.seed), args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
