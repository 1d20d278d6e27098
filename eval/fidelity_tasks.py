"""The fidelity study's prompts (``eval/fidelity.py``): seeded, generated, ~1K tokens of documents each.

Two tasks, both 4-8 documents a prompt (the count drawn per sample from ``DOC_COUNTS``), every
document padded with plain filler sentences to about ``doc_tokens / documents`` tokens, the fact
sentence at a random place among them:

* ``single`` (single hop): ``make_synthetic.retrieval_sample``'s notes, one 4-digit access code a
  note, "What is the access code for the red door?": the note the question names holds the code.
* ``twohop`` (two hops): ``make_synthetic.memo_samples``'s staff records and delivery memo
  (``documents - 1`` records): the question names neither person nor place; the memo names the
  place, the place's record holds the code.

A sample is ``dict(notes=[texts], input=question, answers=[code], target=index, _id=name,
dataset=task)``; the same arguments give the same samples.
"""

from __future__ import annotations

import random

from .data.make_synthetic import CITIES, COLOURS, DAYS, NAMES, PLACES, TOPICS, filler

DOC_COUNTS = (4, 6, 8)  # documents a prompt: one of these per sample
FILLER_TOKENS, PLACE_TOKENS, PLAIN_TOKENS = 16, 11, 10  # about the tokens of one filler sentence of each kind (SmolLM2)
TASKS = ("fact1", "fact2", "single", "twohop")
ANSWER_WORDS = frozenset(c.lower() for c in CITIES)  # the fact tasks' answers: what ``eval.fidelity`` compares


def padded(rng: random.Random, head: str, fact: str, tokens: int, sentence, sentence_tokens: int) -> str:
    """``head``, then filler sentences (``sentence(rng)``, about ``sentence_tokens`` tokens each) to
    about ``tokens`` tokens with ``fact`` among them at a random place."""
    body = [sentence(rng) for _ in range(max(1, round(tokens / sentence_tokens) - 1))]
    body.insert(rng.randrange(len(body) + 1), fact)
    return f"{head} {' '.join(body)}"


def single_sample(rng: random.Random, i: int, doc_tokens: int) -> dict:
    docs = rng.choice(DOC_COUNTS)
    colours = rng.sample(COLOURS, docs)
    codes = [str(rng.randint(1000, 9999)) for _ in colours]
    notes = [padded(rng, f"Note {k + 1}.", f"The access code for the {c} door is {code}.", doc_tokens // docs,
                    lambda r: filler(r, n=1), FILLER_TOKENS)
             for k, (c, code) in enumerate(zip(colours, codes))]
    j = rng.randrange(docs)
    return dict(notes=notes, input=f"What is the access code for the {colours[j]} door? Answer with the code.",
                answers=[codes[j]], target=j, _id=f"single-{i}", dataset="single")


def place_sentence(rng: random.Random) -> str:
    """A filler sentence that names no person and no workplace (both would be decoys for the
    memo's clue): about a city and a day."""
    city, day = rng.choice(CITIES), rng.choice(DAYS)
    return rng.choice((f"The weather in {city} was mild on {day}.", f"The trains to {city} ran late on {day}.",
                       f"A festival in {city} drew large crowds on {day}."))


def twohop_sample(rng: random.Random, i: int, doc_tokens: int) -> dict:
    docs = rng.choice(DOC_COUNTS)
    records = docs - 1
    names, places = rng.sample(NAMES, records), rng.sample(PLACES, records)
    codes = [str(rng.randint(1000, 9999)) for _ in names]
    j = rng.randrange(records)
    per = doc_tokens // docs
    notes = [padded(rng, f"Staff record. {n} works at the {p}.", f"The locker code of {n} is {c}.", per,
                    place_sentence, PLACE_TOKENS) for n, p, c in zip(names, places, codes)]
    notes.append(padded(rng, "Delivery memo.", f"The parcel is for the person who works at the {places[j]}.", per,
                        place_sentence, PLACE_TOKENS))
    order = list(range(docs))
    rng.shuffle(order)  # the memo is not always last: where it sits is part of the task
    notes = [notes[k] for k in order]
    return dict(notes=notes, input="The memo says who the parcel is for. What is the locker code of that person? "
                                         "Answer with the code.",
                answers=[codes[j]], target=order.index(j), _id=f"twohop-{i}", dataset="twohop")


THINGS = tuple(w for words in TOPICS.values() for w in words)
ADJECTIVES = "quiet busy bright calm crowded tidy old new small large".split()


def plain_sentence(rng: random.Random) -> str:
    """A filler sentence that names no person and no city (either would be a decoy for the fact
    tasks' questions): about a thing and a day."""
    thing, adj, day = rng.choice(THINGS), rng.choice(ADJECTIVES), rng.choice(DAYS)
    return rng.choice((f"The {thing} was {adj} on {day}.", f"On {day} the {thing} looked {adj}.",
                       f"Everyone agreed the {thing} was {adj} that {day}."))


def fact1_sample(rng: random.Random, i: int, doc_tokens: int) -> dict:
    docs = rng.choice(DOC_COUNTS)
    names, cities = rng.sample(NAMES, docs), rng.sample(CITIES, docs)
    notes = [padded(rng, f"About {n}.", f"{n} lives in {c}.", doc_tokens // docs, plain_sentence, PLAIN_TOKENS)
             for n, c in zip(names, cities)]
    j = rng.randrange(docs)
    return dict(notes=notes, input=f"In which city does {names[j]} live? Answer with the city name only.",
                answers=[cities[j]], target=j, _id=f"fact1-{i}", dataset="fact1")


def fact2_sample(rng: random.Random, i: int, doc_tokens: int) -> dict:
    docs = rng.choice(DOC_COUNTS)
    records = docs - 1
    names, cities = rng.sample(NAMES, records), rng.sample(CITIES, records)
    j = rng.randrange(records)
    per = doc_tokens // docs
    notes = [padded(rng, f"About {n}.", f"{n} lives in {c}.", per, plain_sentence, PLAIN_TOKENS)
             for n, c in zip(names, cities)]
    notes.append(padded(rng, "Delivery memo.", f"The parcel is for {names[j]}.", per, plain_sentence, PLAIN_TOKENS))
    order = list(range(docs))
    rng.shuffle(order)  # the memo is not always last
    notes = [notes[k] for k in order]
    return dict(notes=notes, input="In which city does the person named in the delivery memo live? "
                                   "Answer with the city name only.",
                answers=[cities[j]], target=order.index(j), _id=f"fact2-{i}", dataset="fact2")


def samples(task: str, n: int, seed: int = 51, doc_tokens: int = 1000) -> list[dict]:
    """``n`` samples of ``task`` (``TASKS``), about ``doc_tokens`` tokens of documents each."""
    make = {"single": single_sample, "twohop": twohop_sample, "fact1": fact1_sample, "fact2": fact2_sample}
    if task not in make:
        raise ValueError(f"unknown fidelity task {task!r} (known: {', '.join(TASKS)})")
    rng = random.Random(f"{task}:{seed}")
    return [make[task](rng, i, doc_tokens) for i in range(n)]


__all__ = ["ANSWER_WORDS", "DOC_COUNTS", "TASKS", "samples"]
